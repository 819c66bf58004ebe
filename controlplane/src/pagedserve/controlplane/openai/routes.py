"""The OpenAI-compatible routes, over the same `Frontend` as the gRPC API.

`/v1/models` (and `/v1/models/{id}`), `/v1/completions`, `/v1/chat/completions`, and vLLM's
`/tokenize`, `/detokenize` and `/version`. Streaming is server-sent events (`data: {chunk}`
... `data: [DONE]`), with a final usage chunk when `stream_options.include_usage` is set (and the
usage so far on every chunk with `continuous_usage_stats`, as vLLM). Structured outputs
(`response_format`, `structured_outputs`, `guided_*`) are read by `structured.py` into the
request's constraint, named as the client put it.
Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are read by `pagedserve.controlplane.tools` and the
answers' calls rendered by `tool_calls.py`. Errors are OpenAI's error JSON (`errors.py`); the
SSE body and disconnects are `streaming.py`'s; computed values (logprobs, usage) `render.py`'s.
`chat_run` (and `chat_prompt`) is also how the APIs translated onto chat run their requests
(pagedserve.controlplane.anthropic, pagedserve.controlplane.responses).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.common.log import get_logger
from pagedserve.common.version import __version__
from pagedserve.controlplane.errors import invalid_argument
from pagedserve.controlplane.frontend import CompletionDone, Frontend, StreamEvent, TextDelta
from pagedserve.controlplane.openai.echo import legacy_logprobs, vllm_prompt_logprobs
from pagedserve.controlplane.openai.echo import prompt_only as prompt_only_events
from pagedserve.controlplane.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.controlplane.openai.render import (
    floored_logprob,
    num_prompts,
    openai_finish,
    openai_usage,
    response_id,
    sampling_fields,
)
from pagedserve.controlplane.openai.running import Choice, collected, merged_events, opened
from pagedserve.controlplane.openai.streaming import sse_body
from pagedserve.controlplane.openai.structured import NONE as NO_STRUCTURED
from pagedserve.controlplane.openai.structured import Structured, structured_output
from pagedserve.controlplane.openai.tool_calls import ChoiceOutput, ChoiceToolCalls, tool_use_of
from pagedserve.controlplane.reasoning import ChoiceReasoning
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.tools.definitions import ToolUse
from pagedserve.controlplane.tools.forced import forced_constraint
from pagedserve.protos.pagedserve.v1 import common_pb2

log = get_logger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


@dataclass(frozen=True)
class ChatRun:
    """A validated chat request, ready to run: its generation requests, its tools and the
    parser of its answers' tool calls (None when the model may call none)."""

    gens: list[GenerationRequest]
    tool_use: ToolUse
    calls: ChoiceToolCalls | None
    output: ChoiceOutput  # how answers are read: reasoning, then tool calls or content


class OpenAIRoutes:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.router = APIRouter()
        route = self.router.add_api_route
        route("/v1/models", self.models, methods=["GET"])
        route("/v1/models/{model:path}", self.model, methods=["GET"])
        route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        route("/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        route("/tokenize", self.tokenize, methods=["POST"])
        route("/detokenize", self.detokenize, methods=["POST"])
        route("/version", self.version, methods=["GET"])

    # -- /v1/models, /version -------------------------------------------------------------------
    def _cards(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = []
        for model in self.frontend.model_cards():
            card: dict[str, Any] = {"id": model.id, "object": "model", "created": 0, "owned_by": "pagedserve"}
            if model.max_model_len is not None:
                card["max_model_len"] = model.max_model_len
            cards.append(card)
        return cards

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": self._cards()}

    async def model(self, model: str) -> dict[str, Any]:
        self.frontend.check_model(model)
        cards = self._cards()  # (an alias, a local model's path, is its served name's card)
        return next((card for card in cards if card["id"] == model), cards[0])

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    # -- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """The prompt's token ids exactly as generation would see them (chat messages rendered
        with the model's template; no special tokens added to a text prompt)."""
        self.frontend.check_model(body.model)
        if body.return_token_strs:
            raise invalid_argument("return_token_strs: not supported by this server", "return_token_strs")
        if (body.prompt is None) == (body.messages is None):
            raise invalid_argument("send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            if body.add_special_tokens:
                raise invalid_argument(
                    "add_special_tokens: not supported with messages", "add_special_tokens"
                )
            messages = [m.template_message() for m in body.messages]
            tools = tool_use_of(body.model_extra or {}, NO_STRUCTURED)
            tokens = self.frontend.encode_chat(
                messages, "messages", bool(body.add_generation_prompt), tool_use=tools
            )
        else:
            if body.add_special_tokens:
                raise invalid_argument(
                    "add_special_tokens: this server never adds special tokens to a prompt; "
                    "omit it or send false",
                    "add_special_tokens",
                )
            tokens = self.frontend.encode_text(body.prompt or "", "prompt")
        return {"count": len(tokens), "max_model_len": self.frontend.max_model_len(), "tokens": tokens}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.frontend.check_model(body.model)
        ids = self.frontend.check_token_ids(body.tokens, "tokens") if body.tokens else []
        return {"prompt": self.frontend.tokenizer.decode(ids)}

    # -- shared -----------------------------------------------------------------------------------
    def _requests(
        self,
        prompts: Sequence[list[int]],
        body: CompletionRequest | ChatCompletionRequest,
        sampling: dict[str, object],
        http: Request,
        structured: Structured,
        field_names: dict[str, str] | None = None,
    ) -> list[GenerationRequest]:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if structured.constraint is not None:  # named (and renamed on refusal) as the client put it
            sampling = {**sampling, "constraint": structured.constraint}
            field_names = {**(field_names or {}), **structured.field_names}
        label = http.headers.get("x-request-id")
        return [
            self.frontend.validate(
                prompt,
                sampling,
                stop,
                request_id=label if label is None or len(prompts) == 1 else f"{label}-{i}",
                cache_salt=body.cache_salt,
                timeout_s=body.timeout,
                priority=body.priority,
                include_stop_str_in_output=bool(body.include_stop_str_in_output),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                bad_words=body.bad_words or (),
                field_prefix="",
                field_names=field_names,
                request_id_field="x-request-id",
            )
            for i, prompt in enumerate(prompts)
        ]

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> Structured:
        """What is checked before any prompt is tokenized: the model, refused parameters, the
        structured output asked for (returned)."""
        self.frontend.check_model(body.model)
        refused = body.unsupported()
        if refused is not None:
            param, message = refused
            raise invalid_argument(message, param)
        return structured_output(body.model_extra or {})

    async def _respond(
        self,
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        gens: list[GenerationRequest],
        render_chunk: Any,
        render_final: Any,
        render_usage_chunk: Any,
        *,
        prompt_only: bool = False,
    ) -> Response:
        """Run the requests; stream SSE chunks or answer one JSON body, as the client asked.
        Until the answer starts, a client that disconnects cancels the request at once (out
        of the admission queue if it waits there: it is never admitted, never runs)."""
        events = merged_events(self.frontend, gens, body.num_choices, http)
        if prompt_only:
            events = prompt_only_events(events)
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            # vLLM's `continuous_usage_stats`: the usage so far on every chunk (with include_usage).
            running_prompt_tokens = (
                sum(g.num_prompt_tokens for g in gens)
                if include_usage and options is not None and options.continuous_usage_stats
                else None
            )
            got = await opened(http, events)
            if got is None:  # the client left while its request queued or prefilled
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return StreamingResponse(
                sse_body(
                    got[0],
                    events,
                    render_chunk,
                    render_usage_chunk if include_usage else None,
                    running_prompt_tokens,
                ),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        choices = await collected(http, events)  # re-raises a ServiceError
        if choices is None:  # the client left: the request was aborted, its blocks freed
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(render_final(choices))

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        structured = self._check(body)
        self.frontend.check_batch(num_prompts(body.prompt), body.num_choices)
        prompts = self._completion_prompts(body.prompt)
        prompt_only = body.max_tokens == 0  # with echo (`unsupported` refuses it otherwise)
        sampling = sampling_fields(body, 1 if prompt_only else body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens lead `logprobs`
            sampling["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
        gens = self._requests(prompts, body, sampling, http, structured)
        written: str | list[str] | list[int] | list[list[int]] = body.prompt
        if body.truncate_prompt_tokens is not None:  # echo and prompt logprobs: the prompt as kept
            prompts = written = [list(g.prompt_token_ids) for g in gens]
        rid, created = f"cmpl-{response_id(http)}", int(time.time())
        decode, n = self._token_text, body.num_choices
        echoed = self._prompt_texts(written, prompts) if body.echo else [""] * len(prompts)

        def base(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
            out = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.frontend.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        def with_prompt_logprobs(choice: dict[str, Any], index: int, entries: Any) -> dict[str, Any]:
            if body.prompt_logprobs is not None:  # vLLM's extra, per choice
                choice["prompt_logprobs"] = vllm_prompt_logprobs(decode, prompts[index // n], entries)
            return choice

        started: set[int] = set()
        scored: dict[int, Any] = {}  # prompt index -> its prompt logprobs (on its choice 0's first chunk)

        def chunk(event: StreamEvent) -> dict[str, Any]:
            if isinstance(event, TextDelta):
                prompt, first = event.index // n, event.index not in started
                started.add(event.index)
                if event.prompt_logprobs:
                    scored[prompt] = event.prompt_logprobs
                echo = bool(body.echo) and first  # each choice's first chunk leads with its prompt
                lps = None
                if body.logprobs is not None:
                    echo_ids = prompts[prompt] if echo else ()
                    lps = legacy_logprobs(
                        decode, event.token_ids, event.logprobs, echo_ids, scored.get(prompt, ())
                    )
                text = (echoed[prompt] if echo else "") + event.text
                choice = {"index": event.index, "text": text, "logprobs": lps, "finish_reason": None}
                if event.index % n == 0 and first:  # its prompt's first chunk
                    choice = with_prompt_logprobs(choice, event.index, event.prompt_logprobs)
                return base([choice])
            return base(
                [{"index": event.index, "text": "", "logprobs": None, "finish_reason": openai_finish(event)}]
            )

        def final(choices: dict[int, Choice]) -> dict[str, Any]:
            out = []
            for index, c in choices.items():
                first = choices.get(index - index % n, c)  # completion 0 carries its prompt's logprobs
                lps = None
                if body.logprobs is not None:
                    echo = prompts[index // n] if body.echo else ()
                    lps = legacy_logprobs(decode, c.token_ids, c.logprobs, echo, first.prompt_logprobs)
                choice = {
                    "index": index,
                    "text": echoed[index // n] + "".join(c.text),
                    "logprobs": lps,
                    "finish_reason": openai_finish(c.done) if c.done else None,
                }
                out.append(with_prompt_logprobs(choice, index, first.prompt_logprobs))
            return base(out, openai_usage([c.done for c in choices.values() if c.done], n))

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], openai_usage(done, n))

        return await self._respond(http, body, gens, chunk, final, usage_chunk, prompt_only=prompt_only)

    def _prompt_texts(
        self, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]
    ) -> list[str]:
        """What echo prepends: each prompt as the client wrote it (token ids decoded)."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return [self.frontend.tokenizer.decode(p, skip_special_tokens=False) for p in ids]

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.frontend.encode_text(prompt, "prompt")]
        if not prompt:
            raise invalid_argument("prompt must not be empty")
        if all(isinstance(p, str) for p in prompt):
            return [self.frontend.encode_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, int) for p in prompt):
            return [self.frontend.check_token_ids(prompt, "prompt")]  # type: ignore[arg-type]
        return [self.frontend.check_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]

    # -- /v1/chat/completions ---------------------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ToolUse, Structured]:
        """A chat request's prompt token ids (its tools in the template), its tools and its
        structured output (a forced tool call's grammar included), checked."""
        structured = self._check(body)
        tool_use = tool_use_of(
            body.model_extra or {}, structured, self.frontend.dispatcher.config.max_tool_calls
        )
        forced = forced_constraint(tool_use)
        if forced is not None:
            constraint, where = forced
            structured = Structured(constraint, {"json_schema": where})
        messages = [m.template_message() for m in body.messages]
        return self.frontend.encode_chat(messages, "messages", tool_use=tool_use), tool_use, structured

    def chat_run(
        self, body: ChatCompletionRequest, http: Request, field_names: Mapping[str, str] | None = None
    ) -> ChatRun:
        """Validate a chat request (refusals raise INVALID_ARGUMENT naming the field, renamed
        by `field_names` where a translated API names it otherwise) into what runs it."""
        prompt, tool_use, structured = self.chat_prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        names = {"logprobs": "top_logprobs", **(field_names or {})}
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        sampling = sampling_fields(body, max_tokens, logprobs)
        gens = self._requests([prompt], body, sampling, http, structured, names)
        calls = (
            ChoiceToolCalls(tool_use, self.frontend.tool_call_format) if tool_use.choice.calls_tools else None
        )
        if tool_use.tools:
            self.frontend.metrics.tool_requests.labels(tool_choice=tool_use.choice.mode).inc()
        parser = self.frontend.reasoning_parser
        reasoning = None if parser == "none" else ChoiceReasoning(parser)
        return ChatRun(gens, tool_use, calls, ChoiceOutput(calls, reasoning))

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        run = self.chat_run(body, http)
        gens, calls, output = run.gens, run.calls, run.output
        rid, created = f"chatcmpl-{response_id(http)}", int(time.time())
        metrics = self.frontend.metrics
        decode = self._token_text

        def chat_logprobs(
            token_ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprob]
        ) -> dict[str, Any] | None:
            if not body.logprobs:
                return None
            content = []
            for t, lp in zip(token_ids, lps, strict=False):
                text = decode(t)
                top = [
                    {
                        "token": decode(x.token_id),
                        "logprob": floored_logprob(x.logprob),
                        "bytes": list(decode(x.token_id).encode()),
                    }
                    for x in lp.top
                ]
                content.append(
                    {
                        "token": text,
                        "logprob": floored_logprob(lp.logprob),
                        "bytes": list(text.encode()),
                        "top_logprobs": top,
                    }
                )
            return {"content": content}

        def base(
            choices: list[dict[str, Any]], obj: str, usage: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.frontend.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        def prompt_logprobs(entries: Sequence[common_pb2.PromptTokenLogprob]) -> list[Any]:
            return vllm_prompt_logprobs(decode, gens[0].prompt_token_ids, entries)

        started: set[int] = set()

        def chunk(event: StreamEvent) -> dict[str, Any] | None:
            if isinstance(event, TextDelta):
                delta = output.feed(event.index, event.text)
                first = event.index not in started
                if first:  # the first chunk of each choice names the role
                    started.add(event.index)
                    delta = {"role": "assistant", **delta}
                elif not delta and not body.logprobs:
                    return None  # a parser held this text back: nothing to send yet
                choice = {
                    "index": event.index,
                    "delta": delta,
                    "logprobs": chat_logprobs(event.token_ids, event.logprobs),
                    "finish_reason": None,
                }
                out = base([choice], "chat.completion.chunk")
                if first and event.index == 0 and body.prompt_logprobs is not None:
                    out["prompt_logprobs"] = prompt_logprobs(event.prompt_logprobs)
                return out
            last = output.finish(event.index)
            if calls is not None:
                metrics.tool_calls.inc(calls.num_calls(event.index))
            reason = openai_finish(event)
            ends = {"finish_reason": reason} if calls is None else calls.ends(event.index, reason)
            return base(
                [{"index": event.index, "delta": last, "logprobs": None, **ends}], "chat.completion.chunk"
            )

        def final(choices: dict[int, Choice]) -> dict[str, Any]:
            out = []
            for index, c in choices.items():
                message = output.message(index, "".join(c.text))
                reason = openai_finish(c.done) if c.done else None
                ends: dict[str, Any] = {"finish_reason": reason}
                if calls is not None:
                    metrics.tool_calls.inc(calls.num_calls(index))
                    ends = calls.ends(index, reason) if reason is not None else ends
                out.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs),
                        **ends,
                    }
                )
            answer = base(
                out,
                "chat.completion",
                openai_usage([c.done for c in choices.values() if c.done], body.num_choices),
            )
            if body.prompt_logprobs is not None:  # vLLM's extra, on the response
                answer["prompt_logprobs"] = prompt_logprobs(choices[0].prompt_logprobs if choices else [])
            return answer

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], "chat.completion.chunk", openai_usage(done, body.num_choices))

        return await self._respond(http, body, gens, chunk, final, usage_chunk)

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)
