"""Sampling parameters of one request: torch-free, so the master and the API share them.

A `SamplingParams` that exists is valid: `__post_init__` runs `validate()` whenever one is
built, also when a decode node decodes one from the wire (msgspec calls it there too, and
`rpc/wire.py` answers such a message as a protocol error), so a node never trusts what a
peer sent. The bounds are what the sampler computes with in float32 and what a msgpack
integer carries:

| field                | allowed                                                  |
|----------------------|----------------------------------------------------------|
| `max_tokens`         | 1 .. MAX_INT32                                           |
| `temperature`        | 0 (greedy), or MIN_TEMPERATURE (1e-5) .. MAX_TEMPERATURE |
| `top_p`              | MIN_TOP_P (1e-5) .. 1                                    |
| `top_k`              | 0 (off) .. MAX_INT32                                     |
| `min_p`              | 0 (off) .. 1                                             |
| `presence_penalty`   | -MAX_PENALTY (-2) .. MAX_PENALTY (2); 0 = off (OpenAI's) |
| `frequency_penalty`  | -MAX_PENALTY (-2) .. MAX_PENALTY (2); 0 = off (OpenAI's) |
| `repetition_penalty` | above 0 .. MAX_REPETITION_PENALTY (2); 1 = off (vLLM's)  |
| `seed`               | None or a signed 64-bit integer                          |
| `stop`               | at most MAX_STOPS (64) strings of 1 .. MAX_STOP_CHARS    |
|                      | (1024) characters, MAX_STOP_BYTES (4 KiB) together       |
| `stop_token_ids`     | each 0 .. MAX_INT32 (the API also checks the vocabulary) |
| `logprobs`           | None or 0 .. MAX_LOGPROBS (20)                           |
| `logit_bias`         | at most MAX_LOGIT_BIAS (1024) (token id, bias) pairs,    |
|                      | distinct ids 0 .. MAX_INT32, bias in [-100, 100]         |
| `min_tokens`         | 0 .. max_tokens: EOS and stop token ids masked before it |
| `guided`             | None or a `Guided` (kind, spec): the output is held to   |
|                      | it by the grammar engine; spec at most MAX_GUIDED_BYTES  |
| `n`                  | 1 .. MAX_CHOICES (128): sequences sampled from the one   |
|                      | prompt, sharing its KV (vLLM's `n`)                      |
"""

from __future__ import annotations

import msgspec

from mooncake.errors import ApiError

# NOTE: below this a temperature divides logits past float32's range (vLLM's
# _SAMPLING_EPS is the same); 0 asks for greedy decoding.
MIN_TEMPERATURE = 1e-5
# NOTE: far past the point where every distribution is uniform; without a bound a value
# beyond float32's range would become inf in the sampler and inf / inf is NaN
MAX_TEMPERATURE = 1e6
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0  # vLLM allows any value above 0; past 2 text degenerates
MIN_TOP_P = 1e-5  # smaller values already keep only the top token; tiny ones underflow float32
MAX_INT32 = 2**31 - 1  # token ids and counts; larger ones name no token and overflow the wire
MAX_LOGPROBS = 20  # as OpenAI allows
# NOTE: stop strings cost their request's decode node an automaton (~100 bytes and a few
# microseconds to build per character, stopmatch.py) and the held-back text grows with the
# longest; OpenAI allows 4
MAX_STOPS = 64
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_BYTES = 4 * 1024  # UTF-8 bytes of all the stop strings together
MAX_LOGIT_BIAS = 1024  # (token id, bias) pairs; OpenAI documents no count, vLLM none either
MAX_BIAS = 100.0  # |bias| (OpenAI's range: -100 bans a token, 100 forces it)
MAX_GUIDED_BYTES = 256 * 1024  # UTF-8 bytes of a guided spec (a JSON schema, a grammar, ...)
# NOTE: each choice is a row of the decode batch (max_batch, 128 by default) and holds
# its own output's KV; OpenAI documents no bound, vLLM none either
MAX_CHOICES = 128
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class Guided(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the whole output, enforced by the grammar engine. `spec` by `kind`:
    json_object: "" (any JSON object); json_schema: the schema as JSON text; regex: the
    pattern; choice: a JSON array of the allowed strings; grammar: EBNF (GBNF) text."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise InvalidSamplingParams(
                f"guided.kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}",
                "guided",
            )
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        _require(size <= MAX_GUIDED_BYTES, "guided", f"at most {MAX_GUIDED_BYTES} bytes", size)


class InvalidSamplingParams(ApiError):
    """A sampling parameter out of its range; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each output token, and when to stop (valid by construction)."""

    max_tokens: int = 256  # output tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # same seed, same prompt -> same tokens
    stop: tuple[str, ...] = ()  # output text ends before the first of these
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: and the top n
    # NOTE: new fields go last with neutral defaults, so that peers without them still
    # decode what this node sends and the other way round
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the top one; 0 = off
    presence_penalty: float = 0.0  # logit -= this once per token already in the output
    frequency_penalty: float = 0.0  # logit -= this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / r if > 0, else * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many
    guided: Guided | None = None  # the output is held to this constraint
    # sequences sampled from this prompt (choice i's seed is seed + i), its KV computed once
    n: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the first bad field and what is allowed."""
        t, p = self.temperature, self.top_p
        _require(
            1 <= self.max_tokens <= MAX_INT32, "max_tokens", f"in [1, {MAX_INT32}]", self.max_tokens
        )
        _require(
            t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
            "temperature",
            f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
            t,
        )
        _require(
            0 <= self.top_k <= MAX_INT32, "top_k", f"in [0, {MAX_INT32}] (0 = off)", self.top_k
        )
        _require(MIN_TOP_P <= p <= 1, "top_p", f"in [{MIN_TOP_P:g}, 1]", p)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 = off)", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)",
                value,
            )
        r = self.repetition_penalty
        _require(
            0 < r <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)",
            r,
        )
        if self.seed is not None:
            _require(-(2**63) <= self.seed < 2**63, "seed", "a signed 64-bit integer", self.seed)
        self._validate_stop()
        for i in self.stop_token_ids:
            _require(0 <= i <= MAX_INT32, "stop_token_ids", f"token ids in [0, {MAX_INT32}]", i)
        self._validate_bias()
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        _require(1 <= self.n <= MAX_CHOICES, "n", f"in [1, {MAX_CHOICES}]", self.n)
        if self.logprobs is not None:
            _require(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"in [0, {MAX_LOGPROBS}]",
                self.logprobs,
            )

    def _validate_bias(self) -> None:
        bias = self.logit_bias
        _require(
            len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens", len(bias)
        )
        for token, value in bias:
            _require(0 <= token <= MAX_INT32, "logit_bias", f"token ids in [0, {MAX_INT32}]", token)
            _require(
                -MAX_BIAS <= value <= MAX_BIAS,
                "logit_bias",
                f"biases in [{-MAX_BIAS:g}, {MAX_BIAS:g}]",
                value,
            )
        _require(len({t for t, _ in bias}) == len(bias), "logit_bias", "distinct token ids", bias)

    def _validate_stop(self) -> None:
        stop = self.stop
        _require(len(stop) <= MAX_STOPS, "stop", f"at most {MAX_STOPS} strings", len(stop))
        for i, s in enumerate(stop):
            if not s or len(s) > MAX_STOP_CHARS:
                raise InvalidSamplingParams(
                    f"stop must be strings of 1 to {MAX_STOP_CHARS} characters, "
                    f"got {len(s)} characters in stop[{i}]",
                    "stop",
                )
        num_bytes = sum(len(s.encode("utf-8", "surrogatepass")) for s in stop)
        _require(
            num_bytes <= MAX_STOP_BYTES,
            "stop",
            f"at most {MAX_STOP_BYTES} bytes of UTF-8 together",
            num_bytes,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        """Whether the sampler needs the tokens so far (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )


def _require(is_ok: bool, param: str, allowed: str, got: object) -> None:
    if not is_ok:
        raise InvalidSamplingParams(f"{param} must be {allowed}, got {got!r}", param)
