"""Request bodies of the OpenAI API we accept (pydantic), and the parameters we refuse.

The vLLM-style extras (`top_k`, `min_p`, `ignore_eos`, `repetition_penalty`, `stop_token_ids`,
`min_tokens`, `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
`truncate_prompt_tokens`, `cache_salt`, `priority`, `prompt_logprobs`) are honoured, so `extra_body={...}` from the official client works; `model` may
be omitted (the served model). Structured outputs (`response_format`, vLLM's
`structured_outputs` and its `guided_*` aliases) are read from the extra fields by
`pagedserve.controlplane.openai.structured`, tools (`tools`, `tool_choice`, `parallel_tool_calls`) by
`pagedserve.controlplane.tools.definitions`. A parameter that would change the output but that we do not
implement (the deprecated `functions`, beam search, ...) is refused with 400 naming it (`unsupported()`), never
silently ignored; other unknown fields (`user`, `store`, `metadata`, ...) are ignored. Values
are range-checked by `Frontend.validate`, not here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.tools.definitions import MAX_CALL_ID_CHARS, history_tool_calls


def _falsy(value: Any) -> bool:
    return not value


def _unset(value: Any) -> bool:
    return value is None


def _true_or_unset(value: Any) -> bool:
    return value is None or value is True


# Parameters of OpenAI's API (or vLLM's extras) that change the output and that we do not
# implement: refused unless they carry their harmless value (the predicate says which).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # (tools, tool_choice and parallel_tool_calls are read by controlplane/src/pagedserve/controlplane/tools/definitions.py;
    # the deprecated functions API is not)
    "functions": _falsy,
    "function_call": lambda v: v in (None, "none"),
    "audio": _unset,
    "modalities": lambda v: v is None or v == ["text"],
    # (structured outputs are read by controlplane/src/pagedserve/controlplane/openai/structured.py; these vLLM options
    # of theirs are not implemented)
    "guided_whitespace_pattern": _unset,
    "structural_tag": _unset,
    "skip_special_tokens": _true_or_unset,
    "spaces_between_special_tokens": _true_or_unset,
    "use_beam_search": _falsy,
    "length_penalty": lambda v: v is None or v == 1,
    "return_tokens_as_token_ids": _falsy,
    "chat_template": _unset,
    "chat_template_kwargs": _falsy,
    "add_generation_prompt": _true_or_unset,
    "continue_final_message": _falsy,
    "documents": _falsy,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so `unsupported()` can see them

    model: str | None = None  # omitted: the served model (as vLLM)
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-compatible extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: EOS and stop_token_ids are masked until min_tokens were generated; only
    # allowed_token_ids (when set) can be generated. Range-checked by `Frontend.validate`.
    min_tokens: StrictInt | None = None
    allowed_token_ids: list[StrictInt] | None = None
    # vLLM's: a matched stop string stays in the text; only the prompt's last N tokens are kept.
    include_stop_str_in_output: StrictBool | None = False
    truncate_prompt_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None  # vLLM's: words never generated
    speculative: StrictBool | None = None  # false: no drafted tokens for this request
    cache_salt: str | None = None
    # Seconds the server may spend on the request, queue included (controlplane/src/pagedserve/controlplane/deadlines.py):
    # past it the response is 504 (a stream ends with the tokens so far, then the error).
    # The OpenAI client's own `timeout` option stays client-side: send this in `extra_body`.
    timeout: float | None = None
    # vLLM's scheduling priority: lower is served earlier, default 0, in [-1e6, 1e6] (checked by
    # `Frontend.validate`); it may preempt running requests of a strictly worse priority.
    priority: int | None = None
    # vLLM's: per prompt token after the first, its logprob plus this many top alternatives
    # (range-checked as `logprobs` is); rendered as vLLM's `prompt_logprobs` list.
    prompt_logprobs: StrictInt | None = None

    @property
    def num_choices(self) -> int:
        """`n`, 1 when omitted or null (its range is checked with the other sampling fields)."""
        return 1 if self.n is None else self.n

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first parameter we refuse, or None."""
        extra = self.model_extra or {}
        for name, harmless in UNSUPPORTED.items():
            if name in extra and not harmless(extra[name]):
                return name, f"{name}: not supported by this server"
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # Unset: the rest of the model's context, as on every other route (OpenAI's own default is 16).
    max_tokens: int | None = None
    logprobs: int | None = None
    # The prompt comes back before each choice's text (and its tokens first in `logprobs`);
    # with max_tokens 0 nothing is generated.
    echo: StrictBool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 needs echo (the prompt's logprobs); else at least 1"
        if self.suffix:
            return "suffix", "suffix: not supported by this server"
        if self.best_of is not None and self.best_of != self.num_choices:
            return "best_of", "best_of: only best_of == n is supported"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = ""  # OpenAI sends JSON text; an object is taken as it is


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (the conversation sends it back)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def unsupported(self, field: str) -> tuple[str, str] | None:
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text":
                    name = f"{field}.content[{j}].type"
                    return name, f"{name}: only text content is supported, got {part.type[:32]!r}"
        if (self.model_extra or {}).get("function_call"):
            name = f"{field}.function_call"
            return name, f"{name}: not supported by this server (send tool_calls)"
        if self.tool_calls:
            for j, call in enumerate(self.tool_calls):
                if call.type != "function":
                    name = f"{field}.tool_calls[{j}].type"
                    return name, f"{name}: must be 'function'"
            try:
                self._history_calls(field)
            except InvalidField as exc:
                return exc.field, f"{exc.field}: {exc.reason}"
        if self.tool_call_id is not None and len(self.tool_call_id) > MAX_CALL_ID_CHARS:
            name = f"{field}.tool_call_id"
            return name, f"{name}: at most {MAX_CALL_ID_CHARS} characters"
        if self.name is not None and len(self.name) > MAX_CALL_ID_CHARS:
            return f"{field}.name", f"{field}.name: at most {MAX_CALL_ID_CHARS} characters"
        return None

    def _history_calls(self, field: str) -> list[dict[str, Any]]:
        calls = [
            (c.id or "", c.function.name, _arguments_text(c.function.arguments))
            for c in self.tool_calls or ()
        ]
        return history_tool_calls(self.role, calls, f"{field}.tool_calls")

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it (OpenAI's shape, arguments as JSON text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self._history_calls("messages")
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for i, message in enumerate(self.messages):
            refused = message.unsupported(f"messages[{i}]")
            if refused is not None:
                return refused
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs: needs logprobs to be true"
        extra = self.model_extra or {}
        if extra.get("echo"):  # vLLM's chat extra
            return "echo", "echo: not supported by this server"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text `prompt` or chat `messages` (exactly one); with messages, the
    `tools` and `tool_choice` of a chat request count as they would there."""

    model_config = ConfigDict(extra="allow")  # tools / tool_choice: read as chat requests read them

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
