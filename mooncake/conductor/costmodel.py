"""The Conductor's cost model: how long a prefill, a decode step and a KV transfer take.

- prefill time (s)      = P(input_len, reused_len), a polynomial in two variables;
- decode step time (s)  = D(batch_size, total_context_len), a polynomial in two variables;
- transfer time (s)     = (bytes + bytes already queued on the path) / path bandwidth;
- SSD read time (s)     = bytes / ssd_read_bytes_per_s, for blocks the pool holds on SSD only.

The polynomials come from `mooncake profile` (a fit to measured runs) or from the analytic
roofline of a named GPU and model (`mooncake.conductor.roofline`). Both are stored in the
same JSON file format, written by `CostModel.save` and read by `CostModel.load`:

    {
      "version": 1,                         # file format version (this module reads 1)
      "model": "llama2-70b",                # ModelSpec name the costs belong to
      "device": "A800 x8 (tp=8)",           # what was measured or modelled
      "source": "roofline" | "profile",
      "kv_bytes_per_token": 327680,         # bytes of K+V per token, all layers
      "kv_capacity_tokens": 1330000,        # tokens of KV one instance's VRAM holds
      "link_bytes_per_s": 1e11,             # default NIC bandwidth of a node, bytes/s
      "ssd_read_bytes_per_s": 2e9,          # SSD read bandwidth of a pool node, bytes/s
                                            # (optional; default 2e9, an NVMe SSD)
      "prefill": {"variables": ["input_len", "reused_len"],
                  "terms": [{"powers": [1, 0], "coef": 1.3e-4}, ...],   # seconds
                  "fit_error": {"rmse_s": 0.0, "max_rel": 0.0, "num_samples": 0}},
      "decode":  {"variables": ["batch_size", "context_len"], "terms": [...], "fit_error": {...}}
    }

A term {"powers": [i, j], "coef": c} contributes c * x**i * y**j seconds (powers 0..4,
coefficients finite; anything else is a CostModelError). `fit_error` is the
root-mean-square error (seconds) and worst relative error of the fit on its samples (zero
for the roofline, which is not a fit). Evaluations are clamped at zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from mooncake.errors import MooncakeError

COST_MODEL_VERSION = 1
DEFAULT_SSD_READ_BYTES_PER_S = 2e9  # bytes/s


class CostModelError(MooncakeError):
    """A cost model file is missing, malformed or of an unknown version."""


class Term(msgspec.Struct, frozen=True):
    powers: tuple[int, int]  # exponents of (x, y)
    coef: float  # seconds per x**i * y**j


class FitError(msgspec.Struct, frozen=True):
    rmse_s: float = 0.0  # root-mean-square error of the fit, seconds
    max_rel: float = 0.0  # worst |predicted - measured| / measured
    num_samples: int = 0


class Poly2(msgspec.Struct, frozen=True):
    """A polynomial in two variables, in seconds."""

    variables: tuple[str, str]
    terms: tuple[Term, ...]
    fit_error: FitError = FitError()


class CorunFactors(msgspec.Struct, frozen=True, kw_only=True):
    """How much slower compute ran with `busy` nodes computing at once on the profiled
    host (`mooncake.model.corun`); the file's polynomials already include them."""

    busy: int  # nodes (one core each) computing at once
    prefill: float  # prefill time beside them / alone
    decode: float  # decode step time beside them / alone


class CostModelFile(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    model: str
    device: str
    source: Literal["roofline", "profile"]
    kv_bytes_per_token: int  # bytes
    kv_capacity_tokens: int  # tokens of KV an instance's VRAM holds after the weights
    link_bytes_per_s: float  # bytes/s of a node's NIC
    prefill: Poly2
    decode: Poly2
    # bytes/s one pool node reads KV from its SSD tier at (a reader of a block held on SSD
    # only waits for it); the default is a datacenter NVMe SSD's, conservatively
    ssd_read_bytes_per_s: float = DEFAULT_SSD_READ_BYTES_PER_S
    corun: CorunFactors | None = None  # profiled on a shared host: the slowdown included


def _power(var: str, n: int) -> list[str]:
    return [] if n == 0 else [var] if n == 1 else [f"{var}**{n}"]


def _compile(poly: Poly2) -> Callable[[float, float], float]:
    """The polynomial as one Python expression (the Conductor evaluates it ~100 times per
    decision). Only validated finite floats and small ints enter the source."""
    terms = []
    for t in poly.terms:
        i, j, c = int(t.powers[0]), int(t.powers[1]), float(t.coef)
        if not (math.isfinite(c) and 0 <= i <= 4 and 0 <= j <= 4):
            raise CostModelError(f"bad {poly.variables} term: powers ({i}, {j}), coef {c}")
        if c:
            terms.append(" * ".join([repr(c), *_power("x", i), *_power("y", j)]))
    body = " + ".join(terms) or "0.0"
    fn: Callable[[float, float], float] = eval(f"lambda x, y: max(0.0, {body})")
    return fn


class CostModel:
    """Predicts prefill, decode-step and transfer times; pure and stateless."""

    def __init__(self, spec: CostModelFile):
        self.spec = spec
        self._prefill = _compile(spec.prefill)
        self._decode = _compile(spec.decode)
        self.step_fn = self._decode  # decode_step_time without the empty-batch check
        self.kv_bytes_per_token = spec.kv_bytes_per_token
        self.kv_capacity_tokens = spec.kv_capacity_tokens
        self.link_bytes_per_s = spec.link_bytes_per_s
        if not spec.ssd_read_bytes_per_s > 0:
            raise CostModelError(
                f"ssd_read_bytes_per_s must be > 0 bytes/s, got {spec.ssd_read_bytes_per_s}"
            )
        self.ssd_read_bytes_per_s = spec.ssd_read_bytes_per_s

    def prefill_time(self, input_len: int, reused_len: int = 0) -> float:
        """Seconds to prefill `input_len` tokens when the first `reused_len` have KV already."""
        if reused_len >= input_len:  # NOTE: at least one token is always computed
            reused_len = input_len - 1 if input_len > 0 else 0
        return self._prefill(input_len, reused_len)

    def decode_step_time(self, batch_size: float, context_len: float) -> float:
        """Seconds of one decode iteration over `batch_size` requests holding
        `context_len` tokens of KV in total (0 when the batch is empty)."""
        return self._decode(batch_size, context_len) if batch_size > 0 else 0.0

    def chunk_time(self, chunk_end: int, chunk_start: int) -> float:
        """Extra seconds a prefill chunk [chunk_start, chunk_end) adds to an iteration (the
        prefill polynomial without its fixed cost, which the iteration pays once)."""
        return max(0.0, self.prefill_time(chunk_end, chunk_start) - self._prefill(0, 0))

    def mixed_step_time(
        self, batch_size: int, context_len: int, chunks: list[tuple[int, int]]
    ) -> float:
        """Seconds of one coupled (vLLM-style) iteration: a decode step plus prefill chunks
        given as (end, start) token positions. Adds the two rooflines, which is an upper
        bound (the weights are read once)."""
        t = self.decode_step_time(batch_size, context_len) if batch_size else self._prefill(0, 0)
        for end, start in chunks:
            t += self.chunk_time(end, start)
        return t

    def ssd_read_time(self, num_bytes: float) -> float:
        """Seconds to read `num_bytes` of KV off a pool node's SSD."""
        return num_bytes / self.ssd_read_bytes_per_s if num_bytes > 0 else 0.0

    @staticmethod
    def transfer_time(num_bytes: float, bytes_per_s: float, queued_bytes: float = 0.0) -> float:
        """Seconds until `num_bytes` arrive over a path already carrying `queued_bytes`."""
        return (num_bytes + queued_bytes) / bytes_per_s if num_bytes > 0 else 0.0

    def save(self, path: str | Path) -> None:
        """Write the model as indented JSON (the `mooncake profile` file format)."""
        data = msgspec.json.format(msgspec.json.encode(self.spec), indent=2)
        Path(path).write_bytes(data + b"\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model file; raises CostModelError naming the problem."""
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise CostModelError(f"cannot read cost model {path}: {e.strerror}") from e
        try:
            version = msgspec.json.decode(raw, type=dict).get("version")
        except msgspec.DecodeError as e:
            raise CostModelError(f"cost model {path} is not valid JSON: {e}") from e
        if version != COST_MODEL_VERSION:
            raise CostModelError(
                f"cost model {path} has version {version!r}; this mooncake reads version "
                f"{COST_MODEL_VERSION}: re-run `mooncake profile`"
            )
        try:
            spec = msgspec.json.decode(raw, type=CostModelFile)
        except msgspec.ValidationError as e:
            raise CostModelError(f"cost model {path}: {e}") from e
        return cls(spec)

    def __repr__(self) -> str:
        return f"CostModel({self.spec.model} on {self.spec.device}, {self.spec.source})"
