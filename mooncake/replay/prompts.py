"""Synthetic prompts for trace requests: token ids from `hash_ids`, scaled down on request.

A trace gives each request its `hash_ids` (one per 512-token block, prefix-chained) and
its `input_length`, but no text. Block `hash_id` becomes a fixed run of token ids
(`hashing.trace_block_tokens`), so two requests that share their first k hash ids share
their first k blocks of tokens exactly, and a server's prefix cache sees the reuse the
trace had.

Scaling shrinks the block and the prompt together, so block boundaries stay where they
were: with `block_tokens = round(512 * scale)`, a request of n blocks whose last block
holds r of 512 tokens gets (n - 1) full blocks and a last block of ceil(r * block_tokens
/ 512) tokens. At scale 0.0625 a 12,000-token prompt (23 blocks + 224 tokens) becomes
23 * 32 + 14 = 750 tokens.

`fit_context` (`mooncake replay` without --scale) lets the replay halve the scale until
every request fits the server's context, which a trace of 100k-token prompts rarely does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mooncake.errors import ConfigError
from mooncake.kv.hashing import trace_prompt_tokens
from mooncake.sim.trace import TraceRecord

TRACE_BLOCK_TOKENS = 512  # block size of the published Mooncake traces

# Words for `--prompt-format text` (servers that take no token ids): token id i becomes
# WORDS[i % len(WORDS)], so shared id prefixes are shared word prefixes. Each word is one
# short, common English word, about one token in most BPE vocabularies.
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "team minute idea kid body back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field role rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class PromptConfig:
    """How trace requests become prompts and output lengths."""

    scale: float = 1.0  # prompt and block length factor
    output_scale: float = 1.0  # output length factor
    max_tokens: int | None = None  # cap on output tokens, None = no cap
    vocab_size: int = 32000  # token ids are drawn from [first_id, vocab_size)
    first_id: int = 0
    seed: int = 0  # another seed, other tokens (a warm server cache does not hit)
    trace_block_tokens: int = TRACE_BLOCK_TOKENS
    # the replay may halve `scale` (and an `output_scale` equal to it) to fit the server
    fit_context: bool = False

    def validate(self) -> None:
        """Raise ConfigError naming the flag that is out of range."""
        problems = []
        if not self.scale > 0:
            problems.append(f"--scale must be > 0, got {self.scale}")
        elif round(self.trace_block_tokens * self.scale) < 1:
            problems.append(
                f"--scale {self.scale} makes blocks of 0 tokens; use at least "
                f"1/{self.trace_block_tokens} = {1 / self.trace_block_tokens:.5f}"
            )
        if not self.output_scale > 0:
            problems.append(f"--output-scale must be > 0, got {self.output_scale}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.first_id < self.vocab_size:
            problems.append(
                f"need 0 <= --first-id < --vocab-size, got {self.first_id} and {self.vocab_size}"
            )
        if problems:
            raise ConfigError(problems)

    @property
    def block_tokens(self) -> int:
        """Tokens per block after scaling (the server's block size should match it)."""
        return max(1, round(self.trace_block_tokens * self.scale))

    def input_len(self, rec: TraceRecord) -> int:
        """Prompt tokens of `rec` after scaling: full blocks stay full, the last one partial."""
        n = len(rec.hash_ids)
        last = rec.input_length - (n - 1) * self.trace_block_tokens  # 1..512 tokens
        assert 1 <= last <= self.trace_block_tokens, (rec.input_length, n)
        last_scaled = math.ceil(last * self.block_tokens / self.trace_block_tokens)
        return (n - 1) * self.block_tokens + last_scaled

    def output_len(self, rec: TraceRecord) -> int:
        """Output tokens to ask for: the trace's, scaled, at least 1, capped by max_tokens."""
        n = max(1, round(rec.output_length * self.output_scale))
        return min(n, self.max_tokens) if self.max_tokens is not None else n

    def fits(self, records: list[TraceRecord], max_len: int) -> bool:
        """Whether every record's prompt and output fit in `max_len` tokens."""
        return all(self.input_len(r) + self.output_len(r) <= max_len for r in records)

    def fitted(self, records: list[TraceRecord], max_len: int) -> PromptConfig:
        """This config with `scale` halved (an `output_scale` equal to it too) until every
        record fits in `max_len` tokens, or blocks are one token; unchanged if they fit."""
        p, out_factor = self, 0.5 if self.output_scale == self.scale else 1.0
        while not p.fits(records, max_len) and p.block_tokens > 1:
            p = replace(p, scale=p.scale / 2, output_scale=p.output_scale * out_factor)
        return p

    def prompt_ids(self, rec: TraceRecord) -> list[int]:
        """The token ids of `rec`'s prompt (deterministic in hash_ids, sizes and seed)."""
        ids = trace_prompt_tokens(
            rec.hash_ids,
            self.input_len(rec),
            self.block_tokens,
            self.vocab_size,
            self.first_id,
            self.seed,
        )
        return ids.tolist()


def ids_to_text(token_ids: list[int]) -> str:
    """The words standing for `token_ids`, space-separated (for text-only servers)."""
    return " ".join(WORDS[i % len(WORDS)] for i in token_ids)
