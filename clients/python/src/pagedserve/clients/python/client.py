"""Sync and asyncio clients for `GenerationService`. Errors surface as `grpc.RpcError` /
`grpc.aio.AioRpcError` carrying the server's status code and message. Calls retry as
`RetryPolicy` says (docs/api.md, "Retries"; the Go and Java clients do the same).

Structured outputs (docs/api.md, "Structured outputs over gRPC"): `generate`, `generate_stream`
and `build_request` take at most one of `json_schema=` (a dict, its JSON text, or a pydantic
model class), `json_object=True`, `regex=`, `choice=[...]` and `grammar=`, which constrain the
output to match it:

    with GenerationClient("127.0.0.1:50051") as client:
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        out = client.generate("A person as JSON:", max_tokens=64, temperature=0.0, json_schema=schema)
        json.loads(out[0].text)  # valid under the schema when finish_reason is "stop"
        client.generate("Is water wet? Answer:", choice=["yes", "no"])[0].text  # "yes" or "no"

A schema or grammar the server cannot compile fails the call with INVALID_ARGUMENT, whose
details start with the field's name ("sampling_params.json_schema could not be compiled ...").

Tools (chat prompts only): `tools=[...]` (OpenAI's `{"type": "function", "function": {...}}`
dicts, or `{"name", "description", "parameters"}`), `tool_choice=` ("none", "auto",
"required" or a function's name in `{"name": ...}` / OpenAI's shape) and
`parallel_tool_calls=`. Each Completion then carries `tool_calls` (id, name, arguments as JSON
text) and `content` (its text outside the calls); `finish_reason` is "tool_calls" when it made
one:

    out = client.generate([{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
                          tool_choice="required", temperature=0.0)
    json.loads(out[0].tool_calls[0].arguments)  # valid under the tool's parameters schema
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from pagedserve.clients.python.constraints import JsonSchema, set_constraint
from pagedserve.clients.python.embeddings import EmbedInput, build_embed_request, vectors
from pagedserve.clients.python.retry import DEFAULT_RETRY, RetryPolicy, _remaining, _wait
from pagedserve.clients.python.tools import (
    ToolCall,
    ToolSpec,
    chat_message,
    tool_choice_message,
    tool_message,
)
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def finish_reason_name(value: int) -> str:
    """The wire's finish reason as the server's APIs spell it ("stop", "length", "abort",
    "tool_calls"); "unknown" for one this client's stubs do not know, or none set. Derived from
    the enum so that the client needs nothing but its stubs."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return "unknown"
    try:
        return (
            common_pb2.FinishReason.Name(common_pb2.FinishReason.ValueType(value))
            .removeprefix("FINISH_REASON_")
            .lower()
        )
    except ValueError:
        return "unknown"


T = TypeVar("T")


@dataclass
class StreamChunk:
    """New tokens of completion `index` and the text they completed; with `prompt_logprobs`
    asked for, completion 0's first chunk also carries one per prompt token after the first."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    prompt_logprobs: list[common_pb2.PromptTokenLogprob] = field(default_factory=list)


@dataclass
class Completion:
    """A finished completion (the last streamed item for its index)."""

    request_id: str
    index: int
    finish_reason: str
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    e2e_seconds: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # with tools: the text outside the calls


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    n: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int | None = None,
    allowed_token_ids: Sequence[int] = (),
    include_stop_str_in_output: bool = False,
    truncate_prompt_tokens: int | None = None,
    bad_words: Sequence[str] = (),
    request_id: str = "",
    cache_salt: str = "",
    priority: int = 0,
    model: str = "",
    json_schema: JsonSchema | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    tools: Sequence[ToolSpec] = (),
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt, a list of token ids or a list of chat messages.
    `tools`, `tool_choice` and `parallel_tool_calls` (chat prompts only) as the module says.
    `logit_bias` maps token ids to a bias in [-100, 100] added to their logits.
    vLLM's `min_tokens`: EOS and stop token ids cannot end a completion before that many
    tokens; `allowed_token_ids`: when non-empty, only these ids can be generated;
    `include_stop_str_in_output`: a matched stop string stays in the text;
    `truncate_prompt_tokens`: only the prompt's last that many tokens are kept; `bad_words`:
    words never generated.
    `prompt_logprobs` (vLLM's): each prompt token's logprob given its prefix plus that many top
    alternatives, on the first chunk of completion 0 (its `TokenChunk.prompt_logprobs`).
    `priority` (vLLM's): lower is scheduled earlier, default 0, in [-1000000, 1000000]; it may
    preempt running requests of a strictly worse priority.

    At most one constraint (structured outputs; two raise ValueError naming both):
    `json_schema` (a dict, its JSON text, or a pydantic model class: its `model_json_schema()`),
    `json_object=True` (any JSON object), `regex` (the whole output matches it), `choice` (the
    output is exactly one of these strings) or `grammar` (EBNF, GBNF dialect, a `root` rule)."""
    params = common_pb2.SamplingParams(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        allowed_token_ids=list(allowed_token_ids),
        include_stop_str_in_output=include_stop_str_in_output,
        bad_words=list(bad_words),
    )
    set_constraint(
        params, json_schema=json_schema, json_object=json_object, regex=regex, choice=choice, grammar=grammar
    )
    params.logit_bias.update(logit_bias or {})
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("seed", seed),
        ("n", n),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
        ("min_tokens", min_tokens),
        ("truncate_prompt_tokens", truncate_prompt_tokens),
    ):
        if value is not None:
            setattr(params, name, value)
    request = generation_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling_params=params, cache_salt=cache_salt, priority=priority
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        request.chat.messages.extend(chat_message(m) for m in prompt)  # type: ignore[arg-type]
        request.chat.tools.extend(tool_message(t) for t in tools)
        if tool_choice is not None:
            request.chat.tool_choice.CopyFrom(tool_choice_message(tool_choice))
        if parallel_tool_calls is not None:
            request.chat.parallel_tool_calls = parallel_tool_calls
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if not request.HasField("chat") and (tools or tool_choice is not None or parallel_tool_calls is not None):
        raise ValueError("tools, tool_choice and parallel_tool_calls need a chat prompt (a list of messages)")
    return request


def _item(response: generation_pb2.GenerateResponse) -> StreamChunk | Completion:
    if response.HasField("chunk"):
        c = response.chunk
        return StreamChunk(response.request_id, c.index, list(c.token_ids), c.text, list(c.prompt_logprobs))
    d = response.complete
    return Completion(
        request_id=response.request_id,
        index=d.index,
        finish_reason=finish_reason_name(d.finish_reason),
        stop_string=d.stop_string or None,
        prompt_tokens=d.usage.prompt_tokens,
        completion_tokens=d.usage.completion_tokens,
        cached_tokens=d.usage.cached_tokens,
        queue_seconds=d.timings.queue_seconds,
        time_to_first_token_seconds=d.timings.time_to_first_token_seconds,
        e2e_seconds=d.timings.e2e_seconds,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in d.tool_calls],
        content=d.content,
    )


class _Collector:
    """Folds a stream into one Completion per index (text and token ids concatenated)."""

    def __init__(self) -> None:
        self.text: dict[int, list[str]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.done: dict[int, Completion] = {}

    def add(self, item: StreamChunk | Completion) -> None:
        if isinstance(item, StreamChunk):
            self.text.setdefault(item.index, []).append(item.text)
            self.tokens.setdefault(item.index, []).extend(item.token_ids)
        else:
            item.text = "".join(self.text.get(item.index, []))
            item.token_ids = self.tokens.get(item.index, [])
            self.done[item.index] = item

    def result(self) -> list[Completion]:
        return [self.done[i] for i in sorted(self.done)]


def _credentials(tls_ca_file: str | None, tls: bool) -> grpc.ChannelCredentials | None:
    if not tls and tls_ca_file is None:
        return None
    root = None if tls_ca_file is None else Path(tls_ca_file).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return () if not api_key else (("authorization", f"Bearer {api_key}"),)


class GenerationClient:
    """Blocking client. `timeout` (seconds) becomes each call's gRPC deadline (retries included);
    `api_key` is sent as `authorization: Bearer`; `tls=True` (or a CA file) connects over TLS;
    `retry` is the retry policy (`NO_RETRY` disables retries)."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        creds = _credentials(tls_ca_file, tls)
        self._channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)
        self.retry = retry

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: Callable[..., T], request: Any) -> T:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for retry in itertools.count(1):
            try:
                return method(request, timeout=_remaining(deadline), metadata=self.metadata)
            except grpc.RpcError as exc:
                wait = _wait(self.retry, retry, False, exc, deadline)
                if wait is None:
                    raise
            time.sleep(wait)
        raise AssertionError("unreachable")

    def generate_stream(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[StreamChunk | Completion]:
        """Stream chunks and, per index, a final Completion. Breaking out of the loop cancels the
        request. `kwargs` are `build_request`'s: sampling parameters and at most one constraint
        (`json_schema=`, `json_object=True`, `regex=`, `choice=`, `grammar=`)."""
        request = build_request(prompt, **kwargs)
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        for retry in itertools.count(1):
            call = self._stub.Generate(request, timeout=_remaining(deadline), metadata=self.metadata)
            started = False
            try:
                for response in call:
                    started = True
                    yield _item(response)
                return
            except grpc.RpcError as exc:
                wait = _wait(self.retry, retry, started, exc, deadline)
                if wait is None:
                    raise
            finally:
                call.cancel()
            time.sleep(wait)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> list[Completion]:
        """One Completion per index (`n`), in index order; `kwargs` as `generate_stream`, e.g.
        `generate(prompt, max_tokens=64, temperature=0.0, json_schema=Person)`."""
        collector = _Collector()
        for item in self.generate_stream(prompt, timeout=timeout, **kwargs):
            collector.add(item)
        return collector.result()

    def tokenize(self, text: str) -> list[int]:
        response = self._unary(self._stub.Tokenize, generation_pb2.TokenizeRequest(text=text))
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return str(self._unary(self._stub.Detokenize, request).text)

    def list_models(self) -> list[str]:
        response = self._unary(self._stub.ListModels, generation_pb2.ListModelsRequest())
        return [m.id for m in response.models]

    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], **kwargs: Any) -> list[list[float]]:
        """One vector per input (text or token ids); `kwargs` are `build_embed_request`'s."""
        return vectors(self._unary(self._stub.Embed, build_embed_request(inputs, **kwargs)))


class AsyncGenerationClient:
    """asyncio client (grpc.aio). Use inside a running event loop. Options as GenerationClient."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        creds = _credentials(tls_ca_file, tls)
        self._channel = (
            grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)
        self.retry = retry

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for retry in itertools.count(1):
            try:
                return await method(request, timeout=_remaining(deadline), metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                wait = _wait(self.retry, retry, False, exc, deadline)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def generate_stream(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[StreamChunk | Completion]:
        """As GenerationClient.generate_stream (constraints included)."""
        request = build_request(prompt, **kwargs)
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        for retry in itertools.count(1):
            call = self._stub.Generate(request, timeout=_remaining(deadline), metadata=self.metadata)
            started = False
            try:
                async for response in call:
                    started = True
                    yield _item(response)
                return
            except grpc.aio.AioRpcError as exc:
                wait = _wait(self.retry, retry, started, exc, deadline)
                if wait is None:
                    raise
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> list[Completion]:
        """As GenerationClient.generate (constraints included)."""
        collector = _Collector()
        async for item in self.generate_stream(prompt, timeout=timeout, **kwargs):
            collector.add(item)
        return collector.result()

    async def tokenize(self, text: str) -> list[int]:
        response = await self._unary(self._stub.Tokenize, generation_pb2.TokenizeRequest(text=text))
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return str((await self._unary(self._stub.Detokenize, request)).text)

    async def list_models(self) -> list[str]:
        response = await self._unary(self._stub.ListModels, generation_pb2.ListModelsRequest())
        return [m.id for m in response.models]

    async def embed(self, inputs: EmbedInput | Sequence[EmbedInput], **kwargs: Any) -> list[list[float]]:
        return vectors(await self._unary(self._stub.Embed, build_embed_request(inputs, **kwargs)))
