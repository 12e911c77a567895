"""Sampling on the logits' device: a fixed set of batched torch ops per step, no host sync.

Use, once per decode step:

    batch = SamplingBatch.build(params, seeds, positions, history, prompt_lens, device)
    out = sample(logits, batch).to_host()

`build` uploads the host-side params in two non-blocking copies from pinned memory;
`sample` never waits for the device (no `.item()`, `.tolist()`, `nonzero`, boolean-mask
indexing or `torch.multinomial`); `to_host` fetches everything in one copy and one
synchronisation. Every branch of the Python code reads the params' host-side flags,
never a device value, so the ops run do not depend on the batch size either.

Per row, in this order (vLLM's sampler, vllm/v1/sample/sampler.py, has the same: its
"logits processors that are not argmax-invariant", min_tokens then logit_bias, then its
penalties, then greedy or the draw):
1. min_tokens: while a row's output is shorter than its `min_tokens`, its stop token ids
   (EOS unless ignore_eos, and stop_token_ids) get -inf. The caller passes those ids per
   row (`min_tokens_stops`; `Sequence.min_tokens_stops` says which), since only it knows
   the row's output length and EOS. The mask is applied last of steps 1-3 here: a bias
   or a penalty leaves -inf at -inf, so the result is vLLM's.
2. logit_bias (OpenAI's): each listed token's bias added to its logit.
3. penalties: vLLM's repetition penalty over prompt
   and output tokens (a seen token's logit divided by r when positive, multiplied by r
   when not), then OpenAI's frequency and presence penalties over the output tokens,
   `logit -= frequency * count + presence * (count > 0)`.
   Each of steps 1-3 runs only when some row of the batch uses it; greedy rows see them
   too.
4. the allowed-token bitmask, only when some row has one (`allowed_bits`: a row's bit t
   clear bans token t: its logit becomes -inf; the grammar engine fills it for guided
   rows, model/grammar.py, and the other rows allow every token), applied after steps 1-3
   so that the penalties' clamp never makes a banned token finite again. It is expanded
   once per step into an additive bias of 0 and -inf (on a CPU by numpy as it is built,
   on a GPU by a few ops from the uploaded bits), so that applying it is one add: a
   boolean `masked_fill` over (B, V) costs ten times as much on a CPU.
5. greedy rows take the argmax (the first max).
6. temperature: the logits are shifted so the top token sits at 0, then divided by the
   temperature (clamped to the validated range), so that nothing overflows.
7. truncation: top-k, min-p (tokens at least min_p times as likely as the top token) and
   then top-p over what is left; the top token always stays.
8. the draw, with the Gumbel-max trick: argmax(log p + G), G = -log(-log u), u uniform in
   (0, 1), samples exactly from p (it is the exponential race argmax p / E, E ~ Exp(1)).
   u is a counter-based hash of (seed, position, token id) in integer torch ops, so a
   seeded request draws the same tokens whatever batch it runs in and whatever its row;
   an unseeded request gets a random seed when its `Sequence` is made.

Logprobs are of the raw model distribution (before penalties, the bitmask, temperature and
truncation), as the OpenAI API reports them. Sampling computes in float32 and never raises
for what the model produced: a row holding inf or NaN (a broken model, an overflow) takes
its top allowed token (the first +inf; NaN never wins) and reports no logprobs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mooncake.model.params import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SamplingParams,
)

_FLOAT_MAX = torch.finfo(torch.float32).max
_MASK32 = 0xFFFFFFFF
# NOTE: the hash computes in int64 lanes holding 32-bit values; multipliers below 2**31
# keep every product below 2**63, so nothing overflows. These two are those of the
# splitmix32 finalizer, a variant of one Hash Prospector found (see _mix32_)
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_SALT_POSITION, _SALT_TOKEN = 0x9E3779B9, 0x85EBCA6B  # so that 0 does not hash to 0
_U_BITS = 23  # uniform resolution: (h + 0.5) / 2**23 is exact in float32, never 0 or 1

# columns of the two uploads: the float32 one is [_F_* columns | biases K], the int64 one
# [_I_* columns | history L | biased token ids K | masked token ids M]; a row's unused
# places hold 0 (history, read up to its length) or -1 (token ids: none)
_F_TEMPERATURE, _F_TOP_P, _F_MIN_P, _F_PRESENCE, _F_FREQUENCY, _F_REPETITION = range(6)
_F_IS_GREEDY = 6
_I_SEED_LO, _I_SEED_HI, _I_POSITION, _I_TOP_K, _I_PROMPT_LEN, _I_HISTORY_LEN = range(6)
_NUM_F, _NUM_I = 7, 6


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # of the chosen token
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), best first


@dataclass
class SamplingBatch:
    """One step's sampling inputs on the device, and the host-side flags that choose which
    ops `sample` runs. Built once per step by `build`; read-only after that."""

    params: tuple[SamplingParams, ...]  # host copy, one per row
    # None for a batch of greedy rows that nothing adjusts, whose argmax reads neither
    floats: Tensor | None  # (B, 7 + K) float32: the _F_* columns, then the biases
    ints: Tensor | None  # (B, 6 + L + K + M) int64: see the column table above
    is_all_greedy: bool
    has_top_k: bool  # some sampled row truncates by top_k, ...
    has_top_p: bool
    has_min_p: bool
    has_output_penalty: bool  # some row has a presence or frequency penalty
    has_repetition: bool  # some row has a repetition penalty
    max_logprobs: int | None  # the largest top-n asked; None when no row asks for logprobs
    # (B, 32 W) float32, 32 W >= V: 0 where the row may take the token, -inf where not;
    # None when no row is constrained (then no op runs for it)
    token_bias: Tensor | None = None
    num_history: int = 0  # L: columns of history
    num_bias: int = 0  # K: the most (token, bias) pairs of a row; 0 = no row has a bias
    num_masked: int = 0  # M: the most ids a row masks for min_tokens; 0 = no row masks

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        history: Sequence[Sequence[int]] | None,
        prompt_lens: Sequence[int] | None,
        device: torch.device | str,
        allowed_bits: Tensor | None = None,
        min_tokens_stops: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """The device tensors of a step. `seeds`: each row's 64-bit seed; `positions`: the
        index in its sequence of the token being sampled; `history`: each row's token ids
        so far (prompt, then output) and `prompt_lens`, needed only when some row has a
        penalty (None otherwise); `allowed_bits`: (B, W) int32 on the host, each row's
        allowed tokens as bits (None: every row allows every token); `min_tokens_stops`:
        per row, the token ids that cannot be sampled at this step because its output is
        under min_tokens (None: no row). Does not wait for the uploads."""
        assert len(params) == len(seeds) == len(positions), (
            len(params),
            len(seeds),
            len(positions),
        )
        masked = min_tokens_stops if min_tokens_stops is not None else [()] * len(params)
        assert len(masked) == len(params), (len(masked), len(params))
        sampled = [p for p in params if not p.is_greedy]
        needs_history = any(p.has_penalty for p in params)
        assert not needs_history or (history is not None and prompt_lens is not None), (
            "a penalty needs the history and the prompt lengths"
        )
        rows = history if needs_history and history is not None else [()] * len(params)
        lens = prompt_lens if needs_history and prompt_lens is not None else [0] * len(params)
        num_history = max((len(h) for h in rows), default=0)
        num_bias = max((len(p.logit_bias) for p in params), default=0)
        num_masked = max((len(m) for m in masked), default=0)
        floats = ints = None
        if sampled or needs_history or num_bias or num_masked:
            floats, ints = _tensors(params, seeds, positions, rows, lens, masked)
            floats, ints = (
                _upload(floats, torch.device(device)),
                _upload(ints, torch.device(device)),
            )
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        token_bias = None
        if allowed_bits is not None:
            assert allowed_bits.dtype == torch.int32 and allowed_bits.shape[0] == len(params), (
                allowed_bits.dtype,
                allowed_bits.shape,
                len(params),
            )
            token_bias = _token_bias(allowed_bits, torch.device(device))
        return cls(
            params=tuple(params),
            floats=floats,
            ints=ints,
            is_all_greedy=not sampled,
            has_top_k=any(p.top_k > 0 for p in sampled),
            has_top_p=any(p.top_p < 1 for p in sampled),
            has_min_p=any(p.min_p > 0 for p in sampled),
            has_output_penalty=any(p.presence_penalty or p.frequency_penalty for p in params),
            has_repetition=any(p.repetition_penalty != 1 for p in params),
            max_logprobs=max(logprobs) if logprobs else None,
            token_bias=token_bias,
            num_history=num_history,
            num_bias=num_bias,
            num_masked=num_masked,
        )

    @property
    def needs_history(self) -> bool:
        return self.has_output_penalty or self.has_repetition

    @property
    def is_adjusted(self) -> bool:
        """Whether some row's logits change before greedy picks (steps 1-3)."""
        return self.needs_history or bool(self.num_bias) or bool(self.num_masked)

    def column(self, index: int) -> Tensor:
        """(B, 1) one float column, broadcast against (B, V)."""
        assert self.floats is not None, "a batch of greedy rows without penalties"
        return self.floats[:, index : index + 1]

    def int_columns(self, start: int, num: int) -> Tensor:
        """(B, num) int columns from `start` (the _I_* columns are 0 .. _NUM_I)."""
        assert self.ints is not None, "set whenever a row is sampled or adjusted"
        return self.ints[:, start : start + num]


def _tensors(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    history: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    masked: Sequence[Sequence[int]],
) -> tuple[Tensor, Tensor]:
    """The float32 and int64 host tensors of `SamplingBatch.build`."""
    num_rows = len(params)
    num_history = max((len(h) for h in history), default=0)
    num_bias = max((len(p.logit_bias) for p in params), default=0)
    num_masked = max((len(m) for m in masked), default=0)
    floats = torch.zeros((num_rows, _NUM_F + num_bias), dtype=torch.float32)
    if num_rows:
        floats[:, :_NUM_F] = torch.tensor([_float_row(p) for p in params], dtype=torch.float32)
    ints = torch.zeros((num_rows, _NUM_I + num_history + num_bias + num_masked), dtype=torch.int64)
    # a 64-bit seed as two 32-bit lanes (two's complement for a negative one)
    meta = [
        [seed & _MASK32, (seed >> 32) & _MASK32, pos, p.top_k, n, len(h)]
        for p, seed, pos, h, n in zip(params, seeds, positions, history, prompt_lens, strict=True)
    ]
    if meta:
        ints[:, :_NUM_I] = torch.tensor(meta, dtype=torch.int64)
    ints[:, _NUM_I + num_history :] = -1
    bias_at, masked_at = _NUM_I + num_history, _NUM_I + num_history + num_bias
    for i, (p, h, m) in enumerate(zip(params, history, masked, strict=True)):
        if h:
            ints[i, _NUM_I : _NUM_I + len(h)] = torch.tensor(h, dtype=torch.int64)
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            ints[i, bias_at : bias_at + len(ids)] = torch.tensor(ids, dtype=torch.int64)
            floats[i, _NUM_F : _NUM_F + len(ids)] = torch.tensor(biases, dtype=torch.float32)
        if m:
            ints[i, masked_at : masked_at + len(m)] = torch.tensor(list(m), dtype=torch.int64)
    return floats, ints


def _clamp(value: float, low: float, high: float, neutral: float) -> float:
    """`value` in [low, high]; NaN -> `neutral`. The params were validated; this keeps the
    ops finite whatever a buggy peer sent."""
    return neutral if math.isnan(value) else min(max(value, low), high)


def _float_row(p: SamplingParams) -> list[float]:
    # NOTE: top_p >= 1 becomes inf, so that float32 rounding of a cumulative sum that
    # reaches 1 early never drops the tail of a row that asked for no top-p
    top_p = p.top_p if p.top_p < 1 else math.inf  # NaN too
    return [
        _clamp(p.temperature, MIN_TEMPERATURE, MAX_TEMPERATURE, MIN_TEMPERATURE),
        top_p,
        _clamp(p.min_p, 0.0, 1.0, 0.0),
        _clamp(p.presence_penalty, -MAX_PENALTY, MAX_PENALTY, 0.0),
        _clamp(p.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, 0.0),
        _clamp(p.repetition_penalty, MIN_TEMPERATURE, MAX_REPETITION_PENALTY, 1.0),
        float(p.is_greedy),
    ]


def _upload(host: Tensor, device: torch.device) -> Tensor:
    """`host` on `device` without waiting: through pinned memory to a GPU."""
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    # NOTE: the caching host allocator keeps `pinned` until the copy has run
    return pinned.to(device, non_blocking=True)


@dataclass
class SampledTokens:
    """What `sample` produced, still on the device."""

    token_ids: Tensor  # (B,) int64
    is_finite: Tensor  # (B,) bool: the row's logits held no inf or NaN
    logprobs: Tensor | None  # (B,) float32, of the chosen token; None when no row asked
    top_ids: Tensor | None  # (B, n) int64, best first; n = the most any row asked
    top_logprobs: Tensor | None  # (B, n) float32
    num_logprobs: tuple[int | None, ...]  # per row, what it asked for (host)

    def to_host(self) -> SampleOutput:
        """Fetch the results: one copy into pinned memory, one synchronisation."""
        cols = [self.token_ids[:, None], self.is_finite[:, None]]
        if self.logprobs is not None:
            cols.append(self.logprobs[:, None])
        if self.top_ids is not None and self.top_logprobs is not None:
            cols += [self.top_ids, self.top_logprobs]
        # NOTE: float64 holds token ids (< 2**31) and float32 logprobs exactly
        packed = torch.cat([c.to(torch.float64) for c in cols], dim=1)  # (B, 2 [+ 1 + 2n])
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            packed = host
        rows = packed.tolist()
        n = 0 if self.top_ids is None else self.top_ids.shape[1]
        token_ids = [int(r[0]) for r in rows]
        chosen: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
        for i, (r, asked) in enumerate(zip(rows, self.num_logprobs, strict=True)):
            if asked is None or not r[1]:
                continue
            chosen[i] = r[2]
            if asked:
                ids, values = r[3 : 3 + n], r[3 + n :]  # best first
                tops[i] = [(int(ids[j]), values[j]) for j in range(min(asked, n))]
        return SampleOutput(token_ids, chosen, tops)


def sample(logits: Tensor, batch: SamplingBatch) -> SampledTokens:
    """One token per row of `logits` (B, V), with batched ops on their device; waits for
    nothing and changes no state."""
    logits = logits.float()
    vocab = logits.shape[1]
    # NOTE: x * 0 is NaN for inf and NaN, 0 else; a plain sum could overflow to inf
    is_finite = logits.mul(0).sum(-1) == 0  # (B,)
    inf = math.inf
    bias = batch.token_bias
    if bias is not None and bias.shape[1] != vocab:
        bias = bias[:, :vocab]
    clean = logits.nan_to_num(-inf, posinf=inf, neginf=-inf)
    if bias is not None:  # NOTE: a banned +inf plus -inf is NaN: banned again
        clean.add_(bias).nan_to_num_(-inf, posinf=inf, neginf=-inf)
    top = clean.argmax(-1)  # (B,) first max (of the allowed tokens)
    token_ids = top
    if not batch.is_all_greedy or batch.is_adjusted:
        # NOTE: the ops below take a broken row without raising; `top` replaces its token
        x = _adjust(logits, batch) if batch.is_adjusted else logits
        if bias is not None:
            # NOTE: `clean` differs from `logits` only in broken rows, which take `top`
            x = x + bias if batch.is_adjusted else clean
        token_ids = x.argmax(-1) if batch.is_adjusted else top  # what greedy rows take
        if not batch.is_all_greedy:
            is_greedy = batch.column(_F_IS_GREEDY)[:, 0] > 0
            token_ids = torch.where(is_greedy, token_ids, _draw(x, batch))
        token_ids = torch.where(is_finite, token_ids, top)
    out = SampledTokens(
        token_ids=token_ids,
        is_finite=is_finite,
        logprobs=None,
        top_ids=None,
        top_logprobs=None,
        num_logprobs=tuple(p.logprobs for p in batch.params),
    )
    if batch.max_logprobs is not None:
        logp = logits.log_softmax(-1)  # the raw model distribution
        out.logprobs = logp.gather(1, token_ids[:, None])[:, 0]
        n = min(batch.max_logprobs, vocab)
        if n:
            out.top_logprobs, out.top_ids = logp.topk(n, dim=-1)
    return out


def _token_bias(bits: Tensor, device: torch.device) -> Tensor:
    """(B, W) int32 allowed bits on the host -> (B, 32 W) float32 on `device`: log of each
    token's bit, 0 where allowed and -inf where banned."""
    if device.type == "cpu":
        return _bias_on_host(bits)
    return _bias_on_device(_upload(bits, device))


def _bias_on_host(bits: Tensor) -> Tensor:
    assert sys.byteorder == "little", "bit t of an int32 word is bit t % 8 of its byte t // 8"
    u = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")  # (B, 32 W)
    with np.errstate(divide="ignore"):
        return torch.from_numpy(np.log(u, dtype=np.float32))


def _bias_on_device(words: Tensor) -> Tensor:
    token = torch.arange(words.shape[1] * 32, device=words.device)
    each = words.index_select(1, token // 32)  # (B, 32 W): each token's word
    return each.bitwise_right_shift_((token % 32).int()).bitwise_and_(1).float().log_()


def _adjust(x: Tensor, batch: SamplingBatch) -> Tensor:
    """(B, V) logits -> after steps 1-3 of the module docstring: the bias, the penalties,
    then the min_tokens mask (which they would leave at -inf in vLLM's order)."""
    vocab = x.shape[1]
    if batch.num_bias:
        assert batch.floats is not None, "set whenever a row has a bias"
        ids = batch.int_columns(_NUM_I + batch.num_history, batch.num_bias)  # (B, K)
        is_valid = (ids >= 0) & (ids < vocab)  # NOTE: -1 pads; an id past V adds nothing
        bias = torch.where(is_valid, batch.floats[:, _NUM_F:], 0.0)
        # NOTE: a padding place adds 0.0 to token 0, which changes no value
        x = x.scatter_add(1, torch.where(is_valid, ids, 0), bias)
    # NOTE: a finite float32 plus a bias within +-100 stays finite (far below half an ulp
    # of the largest float32), so the bias needs no clamp; a row with an inf was broken
    if batch.needs_history:
        x = _penalize(x, batch)
    if batch.num_masked:
        ids = batch.int_columns(_NUM_I + batch.num_history + batch.num_bias, batch.num_masked)
        is_valid = (ids >= 0) & (ids < vocab)
        hits = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        hits.scatter_add_(1, torch.where(is_valid, ids, 0), is_valid.to(torch.uint8))
        x = x.masked_fill(hits.bool(), -math.inf)
    return x


def _penalize(x: Tensor, batch: SamplingBatch) -> Tensor:
    """(B, V) logits -> after the repetition, frequency and presence penalties."""
    num_rows, vocab = x.shape
    ints = batch.ints
    assert ints is not None, "set whenever a row is sampled or penalized"
    history = batch.int_columns(_NUM_I, batch.num_history)  # (B, L), padded with 0
    col = torch.arange(history.shape[1], device=x.device)
    # NOTE: an id past this vocabulary (none should come) is left out, not indexed
    is_valid = (col < ints[:, _I_HISTORY_LEN : _I_HISTORY_LEN + 1]) & (history < vocab)
    index = torch.where(is_valid, history, 0)
    if batch.has_repetition:  # first, as vLLM (model_executor/layers/utils.py)
        is_seen = x.new_zeros(num_rows, vocab).scatter_add_(1, index, is_valid.float()) > 0
        r = batch.column(_F_REPETITION)
        x = torch.where(is_seen, torch.where(x > 0, x / r, x * r), x)
    if batch.has_output_penalty:
        is_output = is_valid & (col >= ints[:, _I_PROMPT_LEN : _I_PROMPT_LEN + 1])
        counts = x.new_zeros(num_rows, vocab).scatter_add_(1, index, is_output.float())
        x = x - batch.column(_F_FREQUENCY) * counts - batch.column(_F_PRESENCE) * (counts > 0)
    # NOTE: a penalty may overflow a huge logit to inf, and inf - inf is NaN in the shift
    return x.clamp(-_FLOAT_MAX, _FLOAT_MAX)


def _draw(x: Tensor, batch: SamplingBatch) -> Tensor:
    """(B, V) logits -> (B,) a token per row drawn from the truncated, tempered distribution
    (greedy and broken rows get a draw too; the caller ignores it)."""
    # <= 0 with the top token at exactly 0, so exp never overflows and it always survives
    scaled = (x - x.max(-1, keepdim=True).values) / batch.column(_F_TEMPERATURE)
    # top-k and min-p keep what reaches a per-row threshold; log(0) = -inf keeps all
    threshold = batch.column(_F_MIN_P).log()  # (B, 1): p / p_top >= min_p, in logits
    if batch.has_top_k or batch.has_top_p:
        sorted_s, order = scaled.sort(-1, descending=True)  # (B, V)
        if batch.has_top_k:
            assert batch.ints is not None
            k = batch.ints[:, _I_TOP_K : _I_TOP_K + 1]
            k = torch.where((k <= 0) | (k > x.shape[1]), x.shape[1], k)  # 0 = off
            threshold = torch.maximum(threshold, sorted_s.gather(1, k - 1))
        sorted_s = sorted_s.masked_fill(sorted_s < threshold, -math.inf)
        if batch.has_top_p:
            probs = sorted_s.softmax(-1)
            drop = probs.cumsum(-1) - probs >= batch.column(_F_TOP_P)
            # NOTE: the top token always stays, whatever float32 made of top_p
            drop[:, 0].fill_(False)
            sorted_s = sorted_s.masked_fill(drop, -math.inf)
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_s)
    elif batch.has_min_p:
        scaled = scaled.masked_fill(scaled < threshold, -math.inf)
    return _gumbel(batch, x.shape[1], x.device).add_(scaled).argmax(-1)


def _gumbel(batch: SamplingBatch, vocab: int, device: torch.device) -> Tensor:
    """(B, V) Gumbel noise -log(-log u), u a hash of (row's seed, row's position, token id)."""
    ints = batch.ints
    assert ints is not None, "set whenever a row is sampled or penalized"
    key = _mix32_((ints[:, _I_POSITION] + _SALT_POSITION).bitwise_and_(_MASK32))  # (B,)
    key = _mix32_(key.bitwise_xor_(ints[:, _I_SEED_HI]))
    key = _mix32_(key.bitwise_xor_(ints[:, _I_SEED_LO]))
    token = _mix32_(torch.arange(vocab, device=device) + _SALT_TOKEN)  # (V,)
    h = _mix32_(key[:, None] ^ token[None, :])  # (B, V) in [0, 2**32)
    u = h.bitwise_right_shift_(32 - _U_BITS).float()  # (B, V) in [0, 2**23)
    u.add_(0.5).mul_(2.0**-_U_BITS)  # in (0, 1)
    return u.log_().neg_().log_().neg_()


def _mix32_(x: Tensor) -> Tensor:
    """`x` (32-bit values held in int64) through a bijection with good avalanche, in place:
    xorshift-multiply rounds as Chris Wellons' Hash Prospector finds them
    (github.com/skeeto/hash-prospector). In place and into one scratch tensor, since on a
    CPU a fresh (B, V) tensor per op costs more than the op."""
    tmp = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
