"""Sync and asyncio clients for `GenerationService`. Errors surface as `grpc.RpcError` /
`grpc.aio.AioRpcError` carrying the server's status code and message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pagedserve.common.protocol import FINISH_REASON_NAMES
from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass
class StreamChunk:
    """New tokens of completion `index` and the text they completed."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str


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
    request_id: str = "",
    cache_salt: str = "",
    model: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt, a list of token ids or a list of chat messages."""
    params = common_pb2.SamplingParams(
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("seed", seed),
        ("n", n),
        ("logprobs", logprobs),
    ):
        if value is not None:
            setattr(params, name, value)
    request = generation_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling_params=params, cache_salt=cache_salt
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(generation_pb2.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return request


def _item(response: generation_pb2.GenerateResponse) -> StreamChunk | Completion:
    if response.HasField("chunk"):
        c = response.chunk
        return StreamChunk(response.request_id, c.index, list(c.token_ids), c.text)
    d = response.complete
    return Completion(
        request_id=response.request_id,
        index=d.index,
        finish_reason=FINISH_REASON_NAMES.get(d.finish_reason, "unknown"),
        stop_string=d.stop_string or None,
        prompt_tokens=d.usage.prompt_tokens,
        completion_tokens=d.usage.completion_tokens,
        cached_tokens=d.usage.cached_tokens,
        queue_seconds=d.timings.queue_seconds,
        time_to_first_token_seconds=d.timings.time_to_first_token_seconds,
        e2e_seconds=d.timings.e2e_seconds,
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
    """Blocking client. `timeout` (seconds) becomes each call's gRPC deadline; `api_key` is sent
    as `authorization: Bearer`; `tls=True` (or a CA file) connects over TLS."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
    ) -> None:
        creds = _credentials(tls_ca_file, tls)
        self._channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate_stream(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[StreamChunk | Completion]:
        """Stream chunks and, per index, a final Completion. Breaking out of the loop cancels the request."""
        call = self._stub.Generate(
            build_request(prompt, **kwargs), timeout=timeout or self.timeout, metadata=self.metadata
        )
        try:
            for response in call:
                yield _item(response)
        finally:
            call.cancel()

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> list[Completion]:
        collector = _Collector()
        for item in self.generate_stream(prompt, timeout=timeout, **kwargs):
            collector.add(item)
        return collector.result()

    def tokenize(self, text: str) -> list[int]:
        return list(
            self._stub.Tokenize(
                generation_pb2.TokenizeRequest(text=text), timeout=self.timeout, metadata=self.metadata
            ).token_ids
        )

    def detokenize(self, token_ids: Sequence[int]) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
        return str(self._stub.Detokenize(request, timeout=self.timeout, metadata=self.metadata).text)

    def list_models(self) -> list[str]:
        response = self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return [m.id for m in response.models]


class AsyncGenerationClient:
    """asyncio client (grpc.aio). Use inside a running event loop. Options as GenerationClient."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
    ) -> None:
        creds = _credentials(tls_ca_file, tls)
        self._channel = (
            grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate_stream(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[StreamChunk | Completion]:
        call = self._stub.Generate(
            build_request(prompt, **kwargs), timeout=timeout or self.timeout, metadata=self.metadata
        )
        try:
            async for response in call:
                yield _item(response)
        finally:
            call.cancel()

    async def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any
    ) -> list[Completion]:
        collector = _Collector()
        async for item in self.generate_stream(prompt, timeout=timeout, **kwargs):
            collector.add(item)
        return collector.result()

    async def tokenize(self, text: str) -> list[int]:
        response = await self._stub.Tokenize(
            generation_pb2.TokenizeRequest(text=text), timeout=self.timeout, metadata=self.metadata
        )
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        response = await self._stub.Detokenize(
            generation_pb2.DetokenizeRequest(token_ids=list(token_ids)), timeout=self.timeout
        )
        return str(response.text)

    async def list_models(self) -> list[str]:
        response = await self._stub.ListModels(
            generation_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return [m.id for m in response.models]
