"""Loading the optional C extensions (`_dataloop`, `_rdmaloop`) as plain shared libraries
with ctypes, which releases the GIL for every call."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_loaded: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def load_library(
    module: str, env_var: str, declare: Callable[[ctypes.CDLL], None], without: str
) -> ctypes.CDLL | None:
    """Extension `module` loaded once, its functions typed by `declare`; None when it was
    not built, does not load, or `env_var` is "0" (`without` says what serves instead)."""
    with _lock:
        if module in _loaded:
            return _loaded[module]
        _loaded[module] = None
        if os.environ.get(env_var, "1") == "0":
            return None
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            log.info("%s not built: %s", module, without)
            return None
        try:
            lib = ctypes.CDLL(spec.origin)
        except OSError as e:
            log.warning("%s (%s) does not load: %s; %s", module, spec.origin, e, without)
            return None
        declare(lib)
        _loaded[module] = lib
        return lib
