"""`pagedserve client generate` against an in-process GenerationService that records what it
was sent and, like the real control plane (Frontend.check_model), answers only to its served
model names: --model reaches GenerateRequest.model, an unknown name fails with NOT_FOUND; the
constraint flags (--json-schema, --choice, ...) set SamplingParams' constraint, one at most."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pagedserve.cli import main
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SERVED = ("tiny", "tiny-alias")


class RecordingGeneration(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str | bytes]] = []

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.model and request.model not in SERVED:  # proto3: "" is unset
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model: {request.model!r} is not served here (this server serves {', '.join(SERVED)})",
            )
        yield generation_pb2.GenerateResponse(
            request_id="r-1", chunk=generation_pb2.TokenChunk(index=0, token_ids=[5], text="Paris")
        )
        yield generation_pb2.GenerateResponse(
            request_id="r-1",
            complete=generation_pb2.GenerateComplete(
                index=0,
                finish_reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1),
            ),
        )


@pytest.fixture
def server() -> Iterator[tuple[str, RecordingGeneration]]:
    servicer = RecordingGeneration()  # type: ignore[abstract]  # (only Generate is called here)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(0)


def test_model_is_sent_in_the_request(
    server: tuple[str, RecordingGeneration], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = server
    assert main(["client", "generate", "--address", address, "--model", "tiny-alias", "The capital"]) == 0
    assert capsys.readouterr().out.strip() == "Paris"
    (request,) = servicer.requests
    assert request.model == "tiny-alias"
    assert request.text == "The capital"
    assert request.sampling_params.max_tokens == 128


def test_without_model_the_server_picks_its_served_model(
    server: tuple[str, RecordingGeneration], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = server
    assert main(["client", "generate", "--address", address, "--chat", "--stream", "hi"]) == 0
    assert capsys.readouterr().out.strip() == "Paris"
    (request,) = servicer.requests
    assert request.model == ""
    assert request.chat.messages[0].content == "hi"


def test_unknown_model_is_refused_with_the_servers_message(
    server: tuple[str, RecordingGeneration], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = server
    assert main(["client", "generate", "--address", address, "--model", "gpt-4", "hi"]) == 1
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err
    assert "'gpt-4' is not served here (this server serves tiny, tiny-alias)" in err


def test_api_key_comes_from_the_environment_unless_given(
    server: tuple[str, RecordingGeneration], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, servicer = server
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert main(["client", "generate", "--address", address, "hi"]) == 0
    assert main(["client", "generate", "--address", address, "--api-key", "from-flag", "hi"]) == 0
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer from-env", "Bearer from-flag"]


def test_constraint_flags_reach_the_sampling_params(
    server: tuple[str, RecordingGeneration], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = server
    schema = tmp_path / "person.schema.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}}')
    assert main(["client", "generate", "--address", address, "--json-schema", f"@{schema}", "hi"]) == 0
    assert main(["client", "generate", "--address", address, "--choice", "yes", "--choice", "no", "hi"]) == 0
    assert main(["client", "generate", "--address", address, "--json-object", "hi"]) == 0
    first, second, third = (r.sampling_params for r in servicer.requests)
    assert first.json_schema == schema.read_text()
    assert list(second.choice.choices) == ["yes", "no"]
    assert third.WhichOneof("constraint") == "json_object" and third.json_object
    with pytest.raises(SystemExit) as info:  # argparse: the constraint flags exclude each other
        main(["client", "generate", "--address", address, "--regex", "a", "--choice", "a", "hi"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["client", "generate", "--address", address, "--json-schema", "@/nonexistent", "hi"]) == 2
    assert len(servicer.requests) == 3


def test_tool_flags_reach_the_chat_request(
    server: tuple[str, RecordingGeneration], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    address, servicer = server
    tool = tmp_path / "weather.json"
    tool.write_text('{"name": "get_weather", "parameters": {"type": "object"}}')
    search = '{"type": "function", "function": {"name": "search", "description": "Search."}}'
    argv = ["client", "generate", "--address", address, "--chat", "--tool", f"@{tool}", "--tool", search]
    assert main([*argv, "--tool-choice", "function:search", "--no-parallel-tool-calls", "hi"]) == 0
    assert main([*argv, "--tool-choice", "required", "hi"]) == 0
    first, second = (r.chat for r in servicer.requests)
    assert [t.name for t in first.tools] == ["get_weather", "search"]
    assert (
        json.loads(first.tools[0].parameters) == {"type": "object"}
        and first.tools[1].description == "Search."
    )
    assert (
        first.tool_choice.mode == generation_pb2.ToolChoice.MODE_FUNCTION
        and first.tool_choice.function_name == "search"
    )
    assert first.HasField("parallel_tool_calls") and not first.parallel_tool_calls
    assert second.tool_choice.mode == generation_pb2.ToolChoice.MODE_REQUIRED and not second.HasField(
        "parallel_tool_calls"
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in lines] == [
        {"index": 0, "finish_reason": "stop", "content": "", "tool_calls": []}
    ] * 2
    assert main(["client", "generate", "--address", address, "--tool", search, "hi"]) == 2
    assert "--tool needs --chat" in capsys.readouterr().err
    assert main([*argv, "--tool-choice", "sometimes", "hi"]) == 2
    assert main(["client", "generate", "--address", address, "--chat", "--tool", "{not json", "hi"]) == 2
    assert len(servicer.requests) == 2
