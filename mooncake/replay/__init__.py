"""`mooncake replay`: a load generator replaying a Mooncake trace against any
OpenAI-compatible server (ours, vLLM, SGLang).

- `prompts`: trace `hash_ids` -> deterministic token ids (shared ids, shared prefixes),
  scaled block and prompt lengths, output lengths.
- `client`: `/v1/models` probe and one timed streaming `/v1/completions` request.
- `runner`: arrivals at the trace's timestamps / speed on one asyncio loop.
- `report`: per-request records -> counts, TTFT/TBT percentiles, SLO attainment.
"""

from mooncake.replay.client import ReplayError, ServerInfo
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import ReplayReport, RequestRecord
from mooncake.replay.runner import ReplayConfig, replay

__all__ = [
    "PromptConfig",
    "ReplayConfig",
    "ReplayError",
    "ReplayReport",
    "RequestRecord",
    "ServerInfo",
    "replay",
]
