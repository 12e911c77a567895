"""mooncake: KVCache-centric disaggregated LLM serving.

`from mooncake import BufferPool` (and `RegisteredBufferPool`) works as with upstream
Mooncake's wheel; the names load lazily, so `import mooncake` stays light.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {"BufferPool", "RegisteredBufferPool"}  # names of mooncake.buffer_pool


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mooncake import buffer_pool

        return getattr(buffer_pool, name)
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")
