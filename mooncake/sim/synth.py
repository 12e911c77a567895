"""Synthetic Mooncake-format traces from a few parameters a user understands.

A trace is a set of *sessions*. A session starts with a prefix, then runs its turns:
turn 1's prompt is the prefix plus a user message; turn k's prompt is turn k-1's prompt
plus that turn's output plus a new user message, so every turn reuses the whole earlier
prompt. The workload kind decides the prefix:

- `conversation`: a system prompt of the session's own (nothing shared across sessions);
- `agent`: one of `agent_prompts` shared system prompts, each followed by its own tool
  definitions (a handful of long common prefixes, reused by many sessions);
- `docqa`: one document of a shared corpus of `docs` (chosen by Zipf popularity with
  exponent `zipf`: document i is picked with weight 1 / i^zipf) after a short shared
  instruction (the system prompt).

Sessions start as a renewal process of `rate` per second whose inter-arrival times have
coefficient of variation `cv` (1: Poisson; otherwise Gamma with shape 1/cv^2: above 1
burstier, below 1 more regular); turns per session are geometric with mean `turns`; a
turn arrives an exponential think time of mean `think_s` after the one before; a session
ends early when a prompt would pass `max_input` tokens. Lengths are lognormal with the
given mean and *spread* (the sigma of the underlying normal): `LengthDist`.

Block ids: block k of a prompt is identified by everything up to its end (prefix-chained,
as the real traces' `hash_ids`), so two prompts share block k exactly when their first
min((k+1) * block_tokens, len) tokens are the same segments; ids are renumbered 0, 1, ...
in order of first appearance in the written trace. Same parameters and seed, same bytes.
"""

from __future__ import annotations

import bisect
import math
import random
from pathlib import Path

import msgspec

from mooncake.errors import ConfigError
from mooncake.sim.trace import TraceError, TraceRecord

KINDS = ("conversation", "agent", "docqa")


class LengthDist(msgspec.Struct, frozen=True):
    """Lognormal token counts: `mean` tokens, `spread` the sigma of the log (0: constant)."""

    mean: float
    spread: float = 0.5

    def draw(self, rng: random.Random) -> int:
        if self.spread == 0:
            return max(1, round(self.mean))
        mu = math.log(self.mean) - self.spread**2 / 2  # so that E[X] = mean
        return max(1, round(rng.lognormvariate(mu, self.spread)))


class SynthParams(msgspec.Struct, frozen=True, kw_only=True):
    """What `mooncake trace synth` takes; each field is the flag of the same name."""

    mix: dict[str, float] = msgspec.field(default_factory=lambda: {"conversation": 1.0})
    sessions: int = 200
    rate: float = 0.5  # session starts per second
    cv: float = 1.0  # coefficient of variation of the inter-arrival times
    turns: float = 4.0  # mean turns per session (geometric, at least 1)
    think_s: float = 20.0  # mean seconds between a session's turns (exponential)
    system_len: LengthDist = LengthDist(1000)
    tools_len: LengthDist = LengthDist(4000)  # agent: tool definitions after the system prompt
    user_len: LengthDist = LengthDist(400)
    doc_len: LengthDist = LengthDist(8000)
    output_len: LengthDist = LengthDist(300)
    agent_prompts: int = 4  # distinct shared agent prefixes
    docs: int = 100  # documents in the docqa corpus
    zipf: float = 1.0  # docqa popularity exponent
    max_input: int = 65536  # tokens: a session ends before a prompt would pass this
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        bad = [k for k in self.mix if k not in KINDS]
        if bad or not self.mix:
            problems.append(f"--mix: kinds must be among {', '.join(KINDS)}, got {bad or 'none'}")
        if any(not w >= 0 for w in self.mix.values()) or not sum(self.mix.values()) > 0:
            problems.append("--mix: weights must be >= 0 and not all 0")
        checks = (
            ("--sessions", self.sessions >= 1, "an integer >= 1"),
            ("--rate", self.rate > 0, "sessions per second, > 0"),
            ("--cv", 0 < self.cv <= 10, "a coefficient of variation in (0, 10]"),
            ("--turns", self.turns >= 1, "a mean >= 1"),
            ("--think-s", self.think_s >= 0, "seconds, >= 0"),
            ("--agent-prompts", self.agent_prompts >= 1, "an integer >= 1"),
            ("--docs", self.docs >= 1, "an integer >= 1"),
            ("--zipf", 0 <= self.zipf <= 5, "an exponent in [0, 5]"),
            ("--block-tokens", self.block_tokens >= 1, "an integer >= 1"),
            ("--max-input", self.max_input >= self.block_tokens, "tokens, >= --block-tokens"),
        )
        for flag, ok, allowed in checks:
            if not ok:
                problems.append(f"{flag}: must be {allowed}, got {getattr(self, _field(flag))}")
        for name in ("system_len", "tools_len", "user_len", "doc_len", "output_len"):
            d = getattr(self, name)
            if not (d.mean >= 1 and 0 <= d.spread <= 3):
                flag = "--" + name.replace("_", "-")
                problems.append(
                    f"{flag}: mean must be >= 1 token and spread in [0, 3], got {d.mean}:{d.spread}"
                )
        if problems:
            raise ConfigError(problems)


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def parse_length(flag: str, text: str) -> LengthDist:
    """`MEAN` or `MEAN:SPREAD` (e.g. "400" or "400:0.8") from flag `flag`."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        nums = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"{flag}: expected MEAN or MEAN:SPREAD tokens, got {text!r}") from None
    return LengthDist(*nums)


def parse_mix(text: str) -> dict[str, float]:
    """`agent` or `conversation:0.5,agent:0.3,docqa:0.2` (weights, normalized)."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        kind, _, weight = item.strip().partition(":")
        try:
            mix[kind] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(
                f"--mix: expected KIND[:WEIGHT],... with KIND among {', '.join(KINDS)}, "
                f"got {text!r}"
            ) from None
    return mix


class _Blocks:
    """Prefix-chained block ids: block k is the chain of (segment, start, end) pieces up
    to its end; equal chains, equal id."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.ids: dict[tuple, int] = {}

    def hash_ids(self, segments: list[tuple[int, int]]) -> list[int]:
        """segments: (segment id, tokens) in prompt order."""
        bt, ids = self.block_tokens, self.ids
        out: list[int] = []
        parent, pieces, room = -1, [], bt
        for seg, n in segments:
            start = 0
            while start < n:
                take = min(room, n - start)
                pieces.append((seg, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = ids.setdefault((parent, tuple(pieces)), len(ids))
                    out.append(parent)
                    pieces, room = [], bt
        if pieces:
            out.append(ids.setdefault((parent, tuple(pieces)), len(ids)))
        return out


def synthesize(p: SynthParams) -> tuple[list[TraceRecord], dict[str, int]]:
    """The trace's records in arrival order, and the number of sessions of each kind."""
    rng = random.Random(p.seed)
    seg = iter(range(1 << 62))  # fresh segment ids
    agent_prefix = [
        [(next(seg), p.system_len.draw(rng)), (next(seg), p.tools_len.draw(rng))]
        for _ in range(p.agent_prompts)
    ]
    instruction = (next(seg), p.system_len.draw(rng))  # docqa's shared instruction
    docs = [(next(seg), p.doc_len.draw(rng)) for _ in range(p.docs)]
    doc_cum = list(_cumulative([1.0 / (i + 1) ** p.zipf for i in range(p.docs)]))
    kinds = [k for k in KINDS if p.mix.get(k, 0) > 0]
    kind_cum = list(_cumulative([p.mix[k] for k in kinds]))
    blocks = _Blocks(p.block_tokens)
    counts = dict.fromkeys(kinds, 0)
    rows: list[tuple[int, int, int, TraceRecord]] = []
    shape = 1.0 / p.cv**2
    t = 0.0
    for s in range(p.sessions):
        if s:
            gap = 1.0 / p.rate
            t += rng.expovariate(1 / gap) if p.cv == 1 else rng.gammavariate(shape, gap / shape)
        kind = kinds[_pick(rng, kind_cum)]
        counts[kind] += 1
        if kind == "conversation":
            prompt = [(next(seg), p.system_len.draw(rng))]
        elif kind == "agent":
            prompt = list(agent_prefix[rng.randrange(p.agent_prompts)])
        else:
            prompt = [instruction, docs[_pick(rng, doc_cum)]]
        turns = 1 + _geometric(rng, p.turns)
        at = t
        for turn in range(turns):
            if turn:
                at += rng.expovariate(1 / p.think_s) if p.think_s > 0 else 0.0
            prompt = prompt + [(next(seg), p.user_len.draw(rng))]
            tokens = sum(n for _, n in prompt)
            if tokens > p.max_input:
                break
            out = p.output_len.draw(rng)
            rec = TraceRecord(round(at * 1000), tokens, out, blocks.hash_ids(prompt))
            rows.append((rec.timestamp, s, turn, rec))
            prompt.append((next(seg), out))
    if not rows:
        raise ConfigError(
            f"--max-input: no session's first prompt fits in {p.max_input} tokens; "
            "raise --max-input or shorten the prefixes (--system-len, --tools-len, --doc-len)"
        )
    rows.sort(key=lambda r: r[:3])
    return _renumber([r[3] for r in rows]), counts


def _cumulative(weights: list[float]) -> list[float]:
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        out.append(acc)
    out[-1] = 1.0
    return out


def _pick(rng: random.Random, cum: list[float]) -> int:
    return bisect.bisect_right(cum, rng.random())


def _geometric(rng: random.Random, mean: float) -> int:
    """Extra turns after the first: geometric on {0, 1, ...} with mean `mean` - 1."""
    if mean <= 1:
        return 0
    q = 1.0 - 1.0 / mean  # chance of one more turn
    return int(math.log(1.0 - rng.random()) / math.log(q))


def _renumber(records: list[TraceRecord]) -> list[TraceRecord]:
    """Block ids 0, 1, ... in order of first appearance."""
    new: dict[int, int] = {}
    return [
        msgspec.structs.replace(r, hash_ids=[new.setdefault(h, len(new)) for h in r.hash_ids])
        for r in records
    ]


def write_trace(path: str | Path, records: list[TraceRecord]) -> int:
    """Write `records` as JSON lines; returns the bytes written."""
    enc = msgspec.json.Encoder()
    data = b"".join(enc.encode(r) + b"\n" for r in records)
    try:
        Path(path).write_bytes(data)
    except OSError as e:
        raise TraceError(f"cannot write trace {path}: {e.strerror}") from e
    return len(data)
