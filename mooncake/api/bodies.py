"""OpenAI response bodies: completions and chat completions, whole or as stream chunks.

Shapes follow the OpenAI API reference (and vLLM where OpenAI is silent): `n` choices
(index 0 .. n-1; streamed, each chunk holds one choice's step, chat sends a role chunk per
choice first); `usage` (every choice's tokens) with `prompt_tokens_details.cached_tokens`;
completions' legacy
logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's
(`content: [{token, logprob, bytes, top_logprobs}]`). A streamed request gets one chunk per
output token (text may be "" while a character or a stop string is still incomplete), so
a client can time every token.

`return_token_ids` (vLLM's extension, same fields and places): a completion's choice
carries `prompt_token_ids` and `token_ids` (the output's, a stop token included); a chat
completion carries `prompt_token_ids` on the response and `token_ids` on its choice.
Streamed, `prompt_token_ids` comes once, in the first chunk (chat's role chunk), and each
chunk's `token_ids` holds its own token ([] for a chunk that only ends the stream).

With tools (`mooncake.api.tools`), a chat message carries the `tool_calls` read from the
output and the content outside them; streamed, a token's chunk carries the content and
`tool_calls` deltas it decided (text held back while a call may be starting comes later).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake.api.backend import Output
from mooncake.api.tools.stream import ToolStream
from mooncake.conductor.misses import CAUSES, ELSEWHERE_PARTS, MissCounts
from mooncake.model.tokenizer import BaseTokenizer

Body = dict[str, Any]


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> Body:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_body(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    kv_blocks: MissCounts | None = None,
) -> Body:
    """OpenAI's usage; with `kv_blocks` (a backend that attributes its misses), the
    extension `prompt_tokens_details.kv_blocks`: the blocks the prompt could have reused
    (`requested`) by cause, with the elsewhere parts and the evicted blocks' median age."""
    details: dict[str, object] = {"cached_tokens": cached_tokens}
    if kv_blocks is not None:
        details["kv_blocks"] = kv_blocks_body(kv_blocks)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def kv_blocks_body(c: MissCounts) -> dict[str, int | float]:
    ages = sorted(c.evicted_age_s)
    body: dict[str, int | float] = {"requested": c.total}
    body.update({name: getattr(c, name) for name in (*CAUSES, *ELSEWHERE_PARTS)})
    body["evicted_age_p50_s"] = ages[len(ages) // 2] if ages else 0.0
    return body


class ResponseBuilder:
    """Builds the bodies of one request (`is_chat`: chat.completion, else text_completion)."""

    def __init__(
        self,
        req_id: str,
        model: str,
        is_chat: bool,
        tokenizer: BaseTokenizer,
        logprobs: bool,
        prompt_ids: list[int] | None = None,  # set: return token ids (return_token_ids)
        echo: str = "",  # text before each choice's (completions' echo)
        # set: each choice's tool calls are read, by a stream this makes per choice
        tools: Callable[[], ToolStream | None] | None = None,
    ):
        self.req_id, self.model, self.is_chat = req_id, model, is_chat
        self._new_tools = tools
        self._tools: dict[int, ToolStream | None] = {}  # choice -> its tool calls' reader
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.prompt_ids = prompt_ids
        self.is_prompt_sent = False  # streamed: prompt_token_ids went out in a chunk
        self.created = int(time.time())
        self.text_lens: dict[int, int] = {}  # choice -> characters streamed (text_offset)
        self.echo = echo

    def _tools_of(self, index: int) -> ToolStream | None:
        """Choice `index`'s reader of tool calls (None: tool calls are not read)."""
        if self._new_tools is None:
            return None
        if index not in self._tools:
            self._tools[index] = self._new_tools()
        return self._tools[index]

    def _head(self, obj: str) -> Body:
        return {"id": self.req_id, "object": obj, "created": self.created, "model": self.model}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- logprobs -----------------------------------------------------------------------
    def _chat_logprob(self, token_id: int, logprob: float | None) -> Body:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat_logprobs(self, outs: Sequence[Output]) -> Body:
        content = []
        for o in outs:
            if o.token_id is None:  # an end without a token
                continue
            entry = self._chat_logprob(o.token_id, o.logprob)
            entry["top_logprobs"] = [self._chat_logprob(t, lp) for t, lp in o.top_logprobs or []]
            content.append(entry)
        return {"content": content, "refusal": None}

    def completion_logprobs(self, outs: Sequence[Output], offset: int = 0) -> Body:
        """`offset`: characters of the choice's text before `outs`'."""
        body: Body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for o in outs:
            if o.token_id is None:  # an end without a token
                continue
            body["tokens"].append(self._token_text(o.token_id))
            body["token_logprobs"].append(o.logprob)
            top = o.top_logprobs
            body["top_logprobs"].append(
                None if top is None else {self._token_text(t): lp for t, lp in top}
            )
            body["text_offset"].append(offset)
            offset += len(o.text)
        return body

    def _logprobs(self, outs: Sequence[Output], offset: int = 0) -> Body | None:
        tokens = [o for o in outs if o.token_id is not None]
        if not self.logprobs or not tokens:
            return None
        if self.is_chat:
            return self.chat_logprobs(tokens)
        return self.completion_logprobs(tokens, offset)

    # -- whole responses ----------------------------------------------------------------
    def response(self, choices: Sequence[Sequence[Output]], usage: Body) -> Body:
        """The non-streamed body of a finished request: `choices[i]` are the outputs of
        the choice returned at index i (each ends with its finish_reason)."""
        body = self._head("chat.completion" if self.is_chat else "text_completion")
        if self.prompt_ids is not None and self.is_chat:
            body["prompt_token_ids"] = self.prompt_ids
        body["choices"] = [self._choice(i, outs) for i, outs in enumerate(choices)]
        body["usage"] = usage
        return body

    def _choice(self, index: int, outs: Sequence[Output]) -> Body:
        text = "".join(o.text for o in outs)
        finish = outs[-1].finish_reason if outs else "stop"
        choice: Body = {"index": index, "logprobs": self._logprobs(outs), "finish_reason": finish}
        tools = self._tools_of(index) if self.is_chat else None
        if self.is_chat:
            message: Body = {"role": "assistant", "content": text, "refusal": None}
            if tools is not None:
                tools.delta(text, is_last=True)
                message["content"], calls = tools.message()
                if calls:
                    message["tool_calls"] = calls
                choice["finish_reason"] = tools.finish_reason(finish)
            choice["message"] = message
        else:
            choice["text"] = self.echo + text
        if self.prompt_ids is not None:
            choice["token_ids"] = [o.token_id for o in outs if o.token_id is not None]
            if not self.is_chat:
                choice["prompt_token_ids"] = self.prompt_ids
        return choice

    # -- stream chunks ------------------------------------------------------------------
    def _chunk(self, choice: Body, include_usage: bool) -> Body:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        if self.prompt_ids is not None and not self.is_prompt_sent:
            self.is_prompt_sent = True
            (body if self.is_chat else choice)["prompt_token_ids"] = self.prompt_ids
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, include_usage: bool, index: int = 0) -> Body:
        """Chat's first chunk of a choice: the assistant role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choice: Body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if self.prompt_ids is not None:
            choice["token_ids"] = []
        return self._chunk(choice, include_usage)

    def chunk(self, out: Output, include_usage: bool) -> Body:
        """The chunk of one output (a token, the end, or both)."""
        offset = self.text_lens.get(out.index, 0)
        choice: Body = {"index": out.index, "logprobs": self._logprobs([out], offset)}
        finish: str | None = out.finish_reason
        tools = self._tools_of(out.index) if self.is_chat else None
        if tools is not None:
            text, calls = tools.delta(out.text, is_last=finish is not None)
            has_content = text or (out.token_id is not None and not calls)
            choice["delta"] = {"content": text} if has_content else {}
            if calls:
                choice["delta"]["tool_calls"] = calls
            finish = tools.finish_reason(finish)
        elif self.is_chat:
            choice["delta"] = {"content": out.text} if out.token_id is not None or out.text else {}
        else:  # NOTE: echo: the prompt's text leads each choice's first chunk
            choice["text"] = out.text if out.index in self.text_lens else self.echo + out.text
        choice["finish_reason"] = finish
        if self.prompt_ids is not None:
            choice["token_ids"] = [out.token_id] if out.token_id is not None else []
        self.text_lens[out.index] = offset + len(out.text)
        return self._chunk(choice, include_usage)

    def usage_chunk(self, usage: Body) -> Body:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage
        return body
