"""A scripted GenerationService on an ephemeral port, for testing the clients' retry policy
(docs/api.md, "Retries") with exact attempt counts: Python, Go and Java against the same fake.

The prompt picks the script: `"<scenario>#<anything>"` (the suffix keeps runs apart). Each
attempt with the same prompt takes the script's next step (the last one repeats), and the
server counts attempts per prompt.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent import futures

import grpc

from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

OK = ("ok",)
UNAVAILABLE = ("abort", grpc.StatusCode.UNAVAILABLE, "no data plane is available")
INVALID = ("abort", grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature must be >= 0")


def exhausted(retry_after: str | None) -> tuple[str, grpc.StatusCode, str, str | None]:
    return ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue is full", retry_after)


# scenario -> steps. The default policy: 4 attempts, backoff 0.1/0.2/0.4 s, retry-after <= 30 s.
SCRIPTS: dict[str, list[tuple[object, ...]]] = {
    "unavailable-twice": [UNAVAILABLE, UNAVAILABLE, OK],  # 3 attempts, then the text
    "unavailable-always": [UNAVAILABLE],  # 4 attempts, then UNAVAILABLE
    "exhausted-retry-after": [exhausted("0.3"), OK],  # 2 attempts, >= 0.3 s apart
    "exhausted-no-retry-after": [exhausted(None)],  # 1 attempt
    "exhausted-retry-after-too-long": [exhausted("60")],  # 1 attempt (over 30 s)
    "broken-midstream": [("midstream",)],  # 1 attempt: a token arrived, so no retry
    "invalid": [INVALID],  # 1 attempt
    "ok": [OK],
}
EXPECTED_ATTEMPTS = {
    "unavailable-twice": 3,
    "unavailable-always": 4,
    "exhausted-retry-after": 2,
    "exhausted-no-retry-after": 1,
    "exhausted-retry-after-too-long": 1,
    "broken-midstream": 1,
    "invalid": 1,
    "ok": 1,
}
TEXT = "fine, thanks"
PARTIAL = "partial "


class FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def _step(self, prompt: str) -> tuple[object, ...]:
        with self.lock:
            n = self.attempts[prompt]
            self.attempts[prompt] += 1
        script = SCRIPTS[prompt.split("#", 1)[0]]
        return script[min(n, len(script) - 1)]

    @staticmethod
    def _fail(context: grpc.ServicerContext, step: tuple[object, ...]) -> None:
        if step[0] == "exhausted" and step[3] is not None:
            context.set_trailing_metadata((("retry-after", str(step[3])),))
        code = step[1]
        assert isinstance(code, grpc.StatusCode)
        context.abort(code, str(step[2]))

    def Embed(
        self, request: generation_pb2.EmbedRequest, context: grpc.ServicerContext
    ) -> generation_pb2.EmbedResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake server generates only")
        raise AssertionError("unreachable")

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateResponse]:
        prompt = request.text or request.chat.messages[0].content
        step = self._step(prompt)
        rid = request.request_id or "fake-1"
        if step[0] == "midstream":
            yield generation_pb2.GenerateResponse(
                request_id=rid, chunk=generation_pb2.TokenChunk(index=0, token_ids=[1], text=PARTIAL)
            )
            context.abort(
                grpc.StatusCode.UNAVAILABLE, "data plane went away while streaming; retry the request"
            )
        if step[0] != "ok":
            self._fail(context, step)
        for i, word in enumerate(TEXT.split(" ")):
            text = word if i == 0 else " " + word
            yield generation_pb2.GenerateResponse(
                request_id=rid, chunk=generation_pb2.TokenChunk(index=0, token_ids=[10 + i], text=text)
            )
        yield generation_pb2.GenerateResponse(
            request_id=rid,
            complete=generation_pb2.GenerateComplete(
                index=0,
                finish_reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
            ),
        )

    def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        step = self._step(request.text)
        if step[0] != "ok":
            self._fail(context, step)
        return generation_pb2.TokenizeResponse(token_ids=[1, 2, 3])

    def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: grpc.ServicerContext
    ) -> generation_pb2.DetokenizeResponse:
        return generation_pb2.DetokenizeResponse(text="x")

    def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse()


class FakeServer:
    """The fake on 127.0.0.1:<ephemeral> (a thread-pool gRPC server); `stop()` when done."""

    def __init__(self) -> None:
        self.servicer = FakeGeneration()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def attempts(self, prompt: str) -> int:
        with self.servicer.lock:
            return self.servicer.attempts[prompt]

    def stop(self) -> None:
        self.server.stop(0)
