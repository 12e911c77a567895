"""OpenAI request bodies, parsed with msgspec, and their translation to `SamplingParams`.

Every field OpenAI documents for /v1/completions and /v1/chat/completions is known here.
Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, tool and assistant tool-call
messages) is parsed here and planned in `mooncake.api.tools`; structured outputs
(`response_format`, vLLM's `guided_*` and `structured_outputs`) become one `Guided`.
Those we cannot honour are accepted at their neutral value and refused otherwise; an
unknown field is refused, as OpenAI does, so a typo never passes silently. `logit_bias`
is OpenAI's: token ids as decimal strings, biases in [-100, 100].
`n` (1 .. 128) choices share the prompt's KV; completions' `best_of` (n .. 128) generates
that many and returns the n of highest cumulative logprob (vLLM's ranking; OpenAI: "the
one with the highest log probability per token"), and cannot be streamed above n.
`echo` prepends the prompt's text to each choice (not with `logprobs`: the prompt's
logprobs are not computed); `suffix` asks a fill-in-the-middle model for the text between
the prompt and it (`model/fim.py`; refused for a model without FIM tokens).
Extensions (vLLM's): `top_k` (-1 or 0 = off), `min_p` (0 = off), `repetition_penalty`
(1 = off), `min_tokens` (0 = off), `stop_token_ids`, `ignore_eos`. A
completion prompt is a string or a list of token ids (or a list holding exactly one of
those).

Structured outputs (`guided_constraint`): OpenAI's `response_format` (`text`,
`json_object`, `json_schema` with its `schema`), and vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (GBNF or Lark) and their successor `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`), at most one per request, each
becoming `SamplingParams.guided`; the API compiles it before admitting the request
(serving.py), so a constraint the grammar engine cannot compile is a 400 naming its field.

Every error is an `InvalidRequest` whose message names the field and what is allowed.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from mooncake.errors import ApiError
from mooncake.model.params import (
    MAX_BIAS,
    MAX_CHOICES,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    Guided,
    InvalidSamplingParams,
    SamplingParams,
)

T = TypeVar("T")
_Temperature = Annotated[
    float,
    Meta(ge=0, le=MAX_TEMPERATURE, description=f"0 = greedy; else at least {MIN_TEMPERATURE:g}"),
]
_Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
_MaxTokens = Annotated[int, Meta(ge=1)]
_Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]  # OpenAI's; 0 = off
_RepetitionPenalty = Annotated[float, Meta(gt=0, le=MAX_REPETITION_PENALTY)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]  # the backend's vocabulary is checked later


def _only(**schema: object) -> Meta:
    """What the JSON Schema allows of a field parsed in a wider type, so that a refusal
    (`_refuse_unsupported`, `chat_messages`, ...) can say why; no check of its own."""
    return Meta(extra_json_schema=schema)


# NOTE: SamplingParams also bounds their UTF-8 bytes together (MAX_STOP_BYTES)
_StopString = Annotated[str, _only(minLength=1, maxLength=MAX_STOP_CHARS)]
_TokenIds = Annotated[list[TokenId], _only(minItems=1)]


class InvalidRequest(ApiError):
    """A request the API refuses (HTTP `status`, OpenAI `invalid_request_error` body)."""

    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


RETURN_TOKEN_IDS = (
    "Extension (vLLM's): the response also carries the token ids of the prompt "
    "(`prompt_token_ids`: on the choice of a completion, on the response of a chat "
    "completion; streamed, in the first chunk only) and of the output (`token_ids` on the "
    "choice, a stop token included; streamed, each chunk's own token)."
)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False  # a last chunk with `usage` and no choices


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `response_format.json_schema`: the output is a JSON value valid against
    `schema` (enforced whether or not `strict` is set; the keywords the grammar engine
    cannot enforce are refused)."""

    name: Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any]
    strict: bool | None = None


_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (a JSON object),
    or `json_schema` (with `json_schema`)."""

    type: Annotated[str, _only(enum=list(_FORMAT_TYPES))]
    json_schema: JsonSchemaFormat | None = None


# vLLM's structured-output extensions (`guided_*`): a JSON schema (as an object or its JSON
# text), a regular expression, a list of strings, a GBNF (llama.cpp's) or Lark grammar
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_Choices = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs` (the successor of its `guided_*` fields): one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: _Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None  # None = the served model
    max_tokens: _MaxTokens | None = None
    temperature: _Temperature | None = None
    top_p: Annotated[float, Meta(ge=MIN_TOP_P, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None  # extension; -1, 0 = off
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None  # extension; 0 = off
    repetition_penalty: _RepetitionPenalty | None = None  # extension; 1 = off
    seed: _Seed | None = None
    stop: _StopString | Annotated[list[_StopString], _only(maxItems=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    ignore_eos: bool = False  # extension
    return_token_ids: Annotated[bool, Meta(description=RETURN_TOKEN_IDS)] = False  # vLLM's
    # choices returned; they share the prompt's KV (computed once)
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    # OpenAI's: {"token id": bias}; the ids are checked against the vocabulary later
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, _only(pattern="^[0-9]+$")],
                Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)],
            ],
            _only(maxProperties=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # extension: no stop before this many tokens
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extension
    guided_regex: str | None = None  # extension
    guided_choice: _Choices | None = None  # extension
    guided_grammar: str | None = None  # extension
    structured_outputs: StructuredOutputs | None = None  # extension


class CompletionRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    """Body of POST /v1/completions. Besides each field's schema: `prompt` is one prompt
    (text, token ids below the model's vocab_size, or a list holding one of those);
    `stream_options` needs `stream`; the prompt's tokens plus `max_tokens` fit in the
    model's max_model_len; `best_of` is at least `n` and not streamed above it; `echo`
    does not go with `logprobs`; `suffix` needs a text prompt and a model whose vocabulary
    has fill-in-the-middle tokens; `logit_bias` keys are token ids below vocab_size."""

    # text, token ids, or a batch of either (refused unless it holds one prompt); typed to
    # the depth a prompt has, so a deeper one is refused naming where
    prompt: str | Annotated[list[str | TokenId | _TokenIds], _only(minItems=1)]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt's text before each choice's
    # candidates generated, the n of highest cumulative logprob returned (not streamable)
    best_of: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None  # fill in the middle: the text after the completion


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text"]
    text: str


# OpenAI's function names (the API refuses others; a template writes them into the prompt)
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(
    msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    name: Annotated[str, Meta(pattern=TOOL_NAME)]
    description: str | None = None
    # a JSON Schema of the arguments object (checked: tools.plan); None: no arguments
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # held only where the grammar engine holds the output


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text (as the API returned it)


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A call an earlier assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One message; `tool_calls` only on assistant messages (content may then be null),
    `tool_call_id` (required) only on tool messages, which answer the calls of the
    assistant message before them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # what clients send back of an assistant message the API returned: accepted at these
    # values (a refusal and annotations are ignored; audio and the legacy function_call
    # are refused)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Annotated[dict[str, Any], _only(type="null")] | None = None
    function_call: Annotated[dict[str, Any], _only(type="null")] | None = None


class ChatRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    """Body of POST /v1/chat/completions. Besides each field's schema: `top_logprobs`
    needs `logprobs`; `stream_options` needs `stream`; the templated messages plus
    `max_completion_tokens` (or `max_tokens`) fit in the model's max_model_len."""

    messages: Annotated[list[ChatMessage], _only(minItems=1)]
    max_completion_tokens: _MaxTokens | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's)
    # None: "auto" with tools, else "none"; a named function must be one of `tools`
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: Annotated[list[Tool], Meta(min_length=1)] | None = None


def decode_body(body: bytes, body_type: type[T]) -> T:
    """Parse a JSON body; raises InvalidRequest naming the field that is wrong."""
    if not body.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as e:
        text = str(e)
        if text.startswith(("Object contains unknown field", "Object missing required field")):
            name = text.split("`")[1]
            if " - at `$" in text:  # in a nested object (a message, a tool): its path too
                name = text.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") + "." + name
            if text.startswith("Object contains"):
                raise InvalidRequest(f"Unrecognized request argument supplied: {name}", name) from e
            raise InvalidRequest(f"'{name}' is a required property", name) from e
        if " - at `$" not in text:  # the top level itself
            raise InvalidRequest(f"the request body must be a JSON object: {text}") from e
        what, path = text.rsplit(" - at `$", 1)
        param = path.rstrip("`").lstrip(".")
        what = what[0].lower() + what[1:]
        raise InvalidRequest(f"Invalid value for '{param}': {what}", param) from e
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # NOTE: msgspec checks UTF-8 as it decodes a string: up to 0.22 it raised
        # UnicodeDecodeError, from 0.23 a DecodeError ("Invalid UTF-8 encoded string")
        bad = _first_bad_utf8(body)
        if bad is None:
            raise InvalidRequest(f"We could not parse the JSON body of your request: {e}") from e
        field = _field_at(body, offset=bad)
        where = f", in '{field}'" if field else ""
        raise InvalidRequest(
            f"the request body is not valid UTF-8 (at byte {bad}{where}); send JSON in UTF-8",
            field,
        ) from e
    except RecursionError as e:  # a value of Any type (e.g. `tools`) nested too deep
        field = _field_at(body, max_depth=MAX_NESTING)
        what = f"'{field}'" if field else "the request body"
        raise InvalidRequest(
            f"{what} nests arrays or objects too deeply; at most {MAX_NESTING} levels are allowed",
            field,
        ) from e


MAX_NESTING = 100  # levels of arrays/objects the error names; msgspec stops near 1000
# a JSON string (as a unit, so brackets inside it do not count), ":" after it for a key;
# or a bracket
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]', re.DOTALL)


def _first_bad_utf8(body: bytes) -> int | None:
    """The offset of the body's first byte that is not UTF-8; None when it all is."""
    try:
        body.decode()
    except UnicodeDecodeError as e:
        return e.start
    return None


def _field_at(body: bytes, *, offset: int = -1, max_depth: int = 0) -> str | None:
    """The top-level field of the JSON object `body` whose value holds byte `offset`
    (offset >= 0), or that first nests deeper than `max_depth`; None if not found.
    Only called on the error paths: it scans the body in Python."""
    depth, key = 0, None
    for m in _JSON_TOKEN.finditer(body):
        if 0 <= offset < m.start():
            return key
        tok = m.group()
        if m.group(1) is not None:  # a key
            if depth == 1:
                if m.start() <= offset < m.end():
                    return None  # the key itself is not UTF-8
                key = tok[1 : tok.rindex(b'"')].decode("utf-8", "replace")
        elif tok in (b"[", b"{"):
            depth += 1
            if max_depth and depth > max_depth + 1:
                return key
        elif tok in (b"]", b"}"):
            depth -= 1
    return key if offset >= 0 else None


def _refuse_unsupported(req: _Common) -> None:
    """Fields we know but cannot honour: allowed only at their neutral value."""
    checks: list[tuple[bool, str, str]] = [
        (
            req.stream_options is not None and not req.stream,
            "stream_options",
            "is only allowed when stream is true",
        ),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            (
                req.echo and req.logprobs is not None,
                "echo",
                "cannot be combined with logprobs: they would include the prompt's, which are "
                "not computed (a prefill writes the prompt's KV, not its logits); drop one",
            ),
            (
                req.best_of is not None and req.best_of < req.n,
                "best_of",
                f"must be at least n={req.n}, got {req.best_of}",
            ),
            (
                req.stream and (req.best_of or req.n) > req.n,
                "best_of",
                "cannot be streamed when best_of > n: the best choices are known only at the end",
            ),
        ]
    if isinstance(req, ChatRequest):
        checks += [
            (
                req.top_logprobs is not None and not req.logprobs,
                "top_logprobs",
                "requires logprobs=true",
            ),
        ]
    for bad, param, message in checks:
        if bad:
            raise InvalidRequest(f"{param}: {message}", param)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: its text, or its token ids."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if not prompt:
        raise InvalidRequest("prompt: must not be empty", "prompt")
    if all(isinstance(p, str | list) for p in prompt):
        raise InvalidRequest(
            f"prompt: batches of prompts are not supported (got {len(prompt)}); "
            "send one request per prompt",
            "prompt",
        )
    raise InvalidRequest("prompt: expected a string or a list of integer token ids", "prompt")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them (transformers' form): role and text
    content; an assistant message's `tool_calls` with `arguments` as an object, a tool
    message's `tool_call_id`."""
    if not req.messages:
        raise InvalidRequest("messages: must hold at least one message", "messages")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()  # the calls tool messages may answer now
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        where = f"messages[{i}]"
        for field, what in (("audio", "audio"), ("function_call", "legacy function calling")):
            if getattr(m, field) is not None:
                param = f"{where}.{field}"
                raise InvalidRequest(f"{param}: {what} is not supported; send null", param)
        for field, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if getattr(m, field) is not None and m.role != role:
                param = f"{where}.{field}"
                raise InvalidRequest(f"{param}: only {role} messages have {field}", param)
        if m.role == "tool":
            _check_tool_message(m.tool_call_id, call_ids, where)
            msg["tool_call_id"] = m.tool_call_id
        elif m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                _template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)
            ]
            call_ids = {c.id for c in m.tool_calls}
        else:
            call_ids = set()
        out.append(msg)
    return out


def _check_tool_message(call_id: str | None, call_ids: set[str], where: str) -> None:
    if call_id is None:
        param = f"{where}.tool_call_id"
        raise InvalidRequest(f"{param}: a tool message must name the call it answers", param)
    if call_id not in call_ids:
        raise InvalidRequest(
            f"{where}: a tool message answers a call of the last assistant message before "
            f"it; {call_id!r} is not one of its tool_calls' ids "
            f"({', '.join(sorted(call_ids)) or 'it made none'})",
            f"{where}.tool_call_id",
        )


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    """A call as templates read it: transformers' templates write `arguments | tojson`,
    so it is the object, not its JSON text (as vLLM passes it)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        param = f"{where}.function.arguments"
        raise InvalidRequest(
            f'{param}: must be a JSON object as text, e.g. \'{{"city": "Paris"}}\'', param
        )
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


_TOKEN_ID_KEY = re.compile(r"[0-9]+")


def logit_bias(req: CompletionRequest | ChatRequest) -> tuple[tuple[int, float], ...]:
    """The (token id, bias) pairs of `logit_bias`, in ascending id order; raises
    InvalidRequest for a key that is no token id (OpenAI's keys are decimal strings)."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequest(
                f"logit_bias: keys must be token ids written as decimal integers, got {key!r}",
                "logit_bias",
            )
        pairs.append((int(key), bias))
    if len({t for t, _ in pairs}) != len(pairs):  # "7" and "007"
        raise InvalidRequest("logit_bias: a token id is given twice", "logit_bias")
    return tuple(sorted(pairs))


def sampling_params(
    req: CompletionRequest | ChatRequest, max_tokens: int, guided: Guided | None = None
) -> SamplingParams:
    """SamplingParams of a parsed request, with `max_tokens` already resolved; `guided`:
    the constraint `tool_choice` asks for (`tools.plan_tools`)."""
    _refuse_unsupported(req)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise InvalidRequest("stop: empty stop strings are not allowed", "stop")
    num_seqs = num_candidates(req)
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
        if num_seqs > req.n and logprobs is None:
            logprobs = 0  # the ranking reads each token's logprob (not returned)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            guided=one_constraint(guided, found[0] if (found := guided_constraint(req)) else None),
            logit_bias=logit_bias(req),
            min_tokens=req.min_tokens,
            n=num_seqs,
        )  # validated as it is built
    except InvalidSamplingParams as e:
        raise InvalidRequest(str(e), e.param) from e


def one_constraint(tool_guided: Guided | None, format_guided: Guided | None) -> Guided | None:
    """The request's one output constraint: `tool_choice` 'required' or a named function
    (`tool_guided`) and `response_format` / `guided_*` (`format_guided`) cannot both hold
    the output (vLLM refuses a named tool_choice with structured outputs too)."""
    if tool_guided is not None and format_guided is not None:
        raise InvalidRequest(
            "tool_choice: 'required' and a named function hold the output to the tools' "
            "schema, so response_format and guided_* cannot be sent with them; send one",
            "tool_choice",
        )
    return tool_guided or format_guided


def guided_constraint(req: CompletionRequest | ChatRequest) -> tuple[Guided, str] | None:
    """The structured-output constraint a request asks for and the field that asked, or
    None; InvalidRequest when it asks for several or a spec is malformed."""
    asked: list[tuple[str, str, str]] = []  # (field, kind, spec)
    fmt = req.response_format
    if fmt is not None and fmt.type not in _FORMAT_TYPES:
        raise InvalidRequest(
            f"response_format.type must be one of {', '.join(_FORMAT_TYPES)}, got {fmt.type!r}"
            " (vLLM's structural_tag is not supported)",
            "response_format.type",
        )
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", "json_object", ""))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest(
                "response_format: type json_schema needs its json_schema: "
                '{"name": ..., "schema": {...}}',
                "response_format.json_schema",
            )
        schema = msgspec.json.encode(fmt.json_schema.schema).decode()
        asked.append(("response_format", "json_schema", schema))
    asked += _guided(
        "guided_", req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar
    )
    so = req.structured_outputs
    if so is not None:
        if so.json_object:
            asked.append(("structured_outputs.json_object", "json_object", ""))
        asked += _guided("structured_outputs.", so.json, so.regex, so.choice, so.grammar)
    if len(asked) > 1:
        names = ", ".join(field for field, _, _ in asked)
        raise InvalidRequest(
            f"at most one structured-output constraint per request, got {names}; allowed: "
            f"response_format (json_object or json_schema), one of {', '.join(_GUIDED_FIELDS)}"
            ", or one field of structured_outputs",
            asked[1][0],
        )
    if not asked:
        return None
    field, kind, spec = asked[0]
    try:
        return Guided(kind=kind, spec=spec), field
    except InvalidSamplingParams as e:
        raise InvalidRequest(f"{field}: {e}", field) from e


def _guided(
    prefix: str,
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[tuple[str, str, str]]:
    """(field, kind, spec) of vLLM's fields named `prefix` + json/regex/choice/grammar."""
    asked = []
    if schema is not None:
        field = prefix + "json"
        if isinstance(schema, str):
            try:
                is_object = isinstance(json.loads(schema), dict)
            except (ValueError, RecursionError):
                is_object = False
            if not is_object:
                raise InvalidRequest(
                    f"{field}: must be a JSON schema, as an object or its JSON text", field
                )
            spec = schema
        else:
            spec = msgspec.json.encode(schema).decode()
        asked.append((field, "json_schema", spec))
    if regex is not None:
        asked.append((prefix + "regex", "regex", regex))
    if choice is not None:
        asked.append((prefix + "choice", "choice", json.dumps(choice)))
    if grammar is not None:
        asked.append((prefix + "grammar", "grammar", grammar))
    return asked


def num_candidates(req: CompletionRequest | ChatRequest) -> int:
    """Sequences to generate: `best_of` (completions) when given, else `n`."""
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        return req.best_of
    return req.n


def requested_max_tokens(req: CompletionRequest | ChatRequest) -> tuple[int | None, str]:
    """(max tokens the request asks for or None, the field that said it)."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"
