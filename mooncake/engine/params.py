"""Sampling parameters of one request: torch-free, so the master and the API share them."""

from __future__ import annotations

import msgspec

from mooncake.errors import ApiError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each output token, and when to stop."""

    max_tokens: int = 256  # output tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # same seed, same prompt -> same tokens
    stop: tuple[str, ...] = ()  # output text ends before the first of these
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: and the top n

    def validate(self) -> None:
        """Raise ApiError naming the first bad field."""
        problems = [
            (self.max_tokens < 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature < 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k < 0, f"top_k must be >= 0, got {self.top_k}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.logprobs is not None and not 0 <= self.logprobs <= 20, "logprobs must be 0-20"),
        ]
        for bad, message in problems:
            if bad:
                raise ApiError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
