"""Frontend without servers: the one validation of a request (either API) and the stream it
makes of a dispatcher's events (stop strings, n > 1), over a fake dispatcher and tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.common.protocol import sampling_fields_from_proto, sampling_params_from_proto
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import CompletionDone, Frontend, StreamEvent, TextDelta
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.openai.protocol import ChatCompletionRequest
from pagedserve.controlplane.openai.render import sampling_fields
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dispatcher import Admitted, GenerationEvent
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2

WORDS = ["<pad>", "Hello", ",", " world", "!", " How", " are", " you", "?"]
HELLO, COMMA, WORLD, BANG, HOW, ARE, YOU, QUESTION = range(1, 9)
CONTEXT = 64  # the fake data plane's max_model_len


class WordTokenizer:
    """One token per word of WORDS; decoding concatenates them."""

    vocab_size = len(WORDS)
    chat_template = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[t] for t in token_ids)


class FakeDispatcher:
    """Streams scripted token chunks per sample index, then one finish per sample, and
    records the requests it was given and whether its stream was closed before the end."""

    def __init__(
        self, samples: list[list[list[int]]], max_model_len: int | None = CONTEXT, num_blocks: int = 1024
    ) -> None:
        self.samples = samples
        info = None
        if max_model_len is not None:
            info = SimpleNamespace(
                max_model_len=max_model_len, vocab_size=0, num_blocks=num_blocks, block_size=4
            )
        self.connections = {"dp:1": SimpleNamespace(info=info)}
        self.requests: list[GenerationRequest] = []
        self.closed_early: bool | None = None

    async def wait_for_startup(self, deadline: float | None = None) -> None:
        """A data plane has served (the start-up wait is tested in tests/e2e/scaling)."""

    async def generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        rid = request.request_id
        yield Admitted("dp:1", 0.25, 0)
        finished = False
        try:
            for step in range(max(len(chunks) for chunks in self.samples)):
                for index, chunks in enumerate(self.samples):
                    if step < len(chunks):
                        yield dataplane_pb2.TokenDelta(request_id=rid, index=index, token_ids=chunks[step])
            for index, chunks in enumerate(self.samples):
                usage = common_pb2.Usage(
                    prompt_tokens=request.num_prompt_tokens, completion_tokens=sum(map(len, chunks))
                )
                # Like the Dispatcher: the last finish completes the request before it is yielded.
                finished = index == len(self.samples) - 1
                yield dataplane_pb2.RequestFinished(
                    request_id=rid, index=index, finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage
                )
        finally:
            self.closed_early = not finished


def frontend(dispatcher: FakeDispatcher) -> Frontend:
    return Frontend(dispatcher, WordTokenizer(), "tiny", metrics=ControlPlaneMetrics())  # type: ignore[arg-type]


def run(fe: Frontend, gen: GenerationRequest) -> list[StreamEvent]:
    async def collect() -> list[StreamEvent]:
        return [event async for event in fe.stream(gen)]

    return asyncio.run(collect())


def texts(events: list[StreamEvent]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if isinstance(e, TextDelta):
            out[e.index] = out.get(e.index, "") + e.text
    return out


def dones(events: list[StreamEvent]) -> dict[int, CompletionDone]:
    return {e.index: e for e in events if isinstance(e, CompletionDone)}


# -- the stream ------------------------------------------------------------------------------


def test_a_stop_string_cuts_the_text_ends_the_completion_and_aborts_the_rest() -> None:
    dispatcher = FakeDispatcher([[[HELLO], [COMMA], [WORLD], [BANG], [HOW]]])
    fe = frontend(dispatcher)
    gen = fe.validate([HOW, ARE, YOU], {"max_tokens": 8}, ["world"], request_id="r1")
    events = run(fe, gen)
    assert texts(events) == {0: "Hello, "}
    done = dones(events)[0]
    assert (done.finish_reason, done.stop_string) == ("stop", "world")
    assert (done.prompt_tokens, done.completion_tokens, done.queue_seconds) == (3, 3, 0.25)
    assert isinstance(events[-1], CompletionDone)
    assert dispatcher.closed_early  # what still ran on the data plane is aborted


def test_n_completions_stream_under_their_own_index() -> None:
    dispatcher = FakeDispatcher([[[HELLO, COMMA], [WORLD]], [[HOW], [ARE, YOU], [QUESTION]]])
    fe = frontend(dispatcher)
    gen = fe.validate([BANG], {"max_tokens": 3, "n": 2, "seed": 1}, request_id="r2")
    events = run(fe, gen)
    assert texts(events) == {0: "Hello, world", 1: " How are you?"}
    assert {i: (d.finish_reason, d.stop_string, d.completion_tokens) for i, d in dones(events).items()} == {
        0: ("length", None, 3),
        1: ("length", None, 4),
    }
    assert dispatcher.closed_early is False


def test_the_dispatcher_gets_the_validated_request_itself() -> None:
    dispatcher = FakeDispatcher([[[HELLO]]])
    fe = frontend(dispatcher)
    gen = fe.validate([BANG, HOW], {"max_tokens": 1, "temperature": 0.0}, request_id="r3")
    run(fe, gen)
    assert dispatcher.requests == [gen]


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "stop", "message"),
    [
        ({"max_tokens": 0}, (), "sampling_params.max_tokens must be an integer >= 1, got 0"),
        ({"temperature": -1.0}, (), "sampling_params.temperature must be >= 0, got -1.0"),
        ({"top_p": 1.5}, (), "sampling_params.top_p must be in (0, 1], got 1.5"),
        ({"n": 0}, (), "sampling_params.n must be an integer >= 1, got 0"),
        ({"logprobs": 21}, (), "sampling_params.logprobs must be at most 20, got 21"),
        ({"seed": 2**64}, (), f"sampling_params.seed must be at most {2**63 - 1}, got {2**64}"),
        ({}, [""], "sampling_params.stop: at most 16 non-empty strings"),
        ({}, ["x"] * 17, "sampling_params.stop: at most 16 non-empty strings"),
    ],
)
def test_invalid_fields_are_invalid_argument_naming_the_field(
    sampling: dict[str, Any], stop: list[str], message: str
) -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO], sampling, stop)
    assert (err.value.code, err.value.message) == ("INVALID_ARGUMENT", message)
    with pytest.raises(ServiceError) as err:  # an OpenAI body has the fields at its top level
        fe.validate([HELLO], sampling, stop, field_prefix="")
    assert err.value.message == message.removeprefix("sampling_params.")


def test_request_id_and_prompt_are_checked() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    with pytest.raises(ServiceError, match=r"^request_id: at most 256 characters$"):
        fe.validate([HELLO], {}, request_id="x" * 257)
    with pytest.raises(ServiceError, match=r"^prompt: tokenizes to no tokens$"):
        fe.validate([], {})


def test_unset_max_tokens_is_the_rest_of_the_context_over_either_api() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    prompt = [HELLO, COMMA, WORLD]
    over_grpc = fe.validate(prompt, sampling_fields_from_proto(common_pb2.SamplingParams(temperature=0.5)))
    body = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
    )
    over_http = fe.validate(prompt, sampling_fields(body, None, None), field_prefix="")
    assert over_grpc.sampling_params == over_http.sampling_params
    assert over_grpc.max_tokens == CONTEXT - 3
    # A prompt filling the context still gets a valid max_tokens: admission refuses its length.
    assert fe.validate(list(range(1, 9)) * 8, {}).max_tokens == 1
    assert fe.validate(prompt, {"max_tokens": 5}).max_tokens == 5


def test_unset_max_tokens_stops_at_what_a_small_pool_holds() -> None:
    # 5 blocks of 4 tokens hold 20 tokens, fewer than the 64-token context.
    fe = frontend(FakeDispatcher([[[HELLO]]], num_blocks=5))
    assert fe.validate([HELLO, COMMA, WORLD], {}).max_tokens == 20 - 3


def test_without_any_data_plane_an_unset_max_tokens_is_unavailable() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]], max_model_len=None))
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO], {})
    assert err.value.code == "UNAVAILABLE"
    assert fe.validate([HELLO], {"max_tokens": 2}).max_tokens == 2


def test_the_wire_message_carries_exactly_the_validated_params() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    sampling: dict[str, Any] = {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
        "n": 2,
        "logprobs": 3,
    }
    sampling |= {"presence_penalty": 0.100000001, "stop_token_ids": [4], "ignore_eos": True}
    gen = fe.validate([HELLO, COMMA], sampling, ["?"], request_id="r4", cache_salt="salt")
    assert gen.sampling_params.temperature == 0.7
    assert gen.sampling_params.presence_penalty == 0.1  # at wire precision (float32) from the start
    command = gen.to_proto({"traceparent": "00-1-2-01"})
    assert sampling_params_from_proto(command.sampling_params) == gen.sampling_params
    assert list(command.sampling_params.stop) == []  # stop strings are matched in the control plane
    assert (list(command.prompt_token_ids), command.cache_salt) == ([1, 2], "salt")
    # The data plane gets the server's id; the client's is only a label.
    assert command.request_id == gen.request_id != "r4" and gen.client_request_id == gen.label == "r4"
    assert dict(command.trace_context) == {"traceparent": "00-1-2-01"}


# -- limits at the edge (issue 12) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be an integer >= 1, got -1"),
        ({"max_tokens": 2**32}, f"max_tokens must be at most {2**32 - 1}, got {2**32}"),
        ({"top_k": 2**31}, f"top_k must be at most {2**31 - 1}, got {2**31}"),
        ({"n": -1}, "n must be an integer >= 1, got -1"),
        ({"n": 2**40}, f"n must be at most 128, got {2**40}"),
        ({"n": 2**32 - 1}, f"n must be at most 128, got {2**32 - 1}"),
        ({"seed": 2**63}, f"seed must be at most {2**63 - 1}, got {2**63}"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers, got (-1,)"),
        ({"stop_token_ids": [2**32]}, f"stop_token_ids must be at most {2**32 - 1}"),
        ({"temperature": 10**400}, "temperature must be finite, got inf"),
        ({"logit_bias": {1: 101.0}}, "logit_bias values must be in [-100, 100], got 101.0"),
        ({"logit_bias": {9: 1.0}}, "logit_bias keys must be token ids in [0, 9), got [9]"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias must have at most 300 entries, got 301"),
    ],
)
def test_every_numeric_field_is_range_checked_before_conversion(
    sampling: dict[str, Any], message: str
) -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO], sampling, field_prefix="")
    assert (err.value.code, err.value.message) == ("INVALID_ARGUMENT", message)
    assert err.value.param == message.split(" ")[0]


def test_n_is_bounded_before_any_per_sample_state_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr("pagedserve.controlplane.request.IncrementalDetokenizer", lambda *a: built.append(a))
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    with pytest.raises(ServiceError, match=r"^sampling_params\.n must be at most 128, got 4294967295$"):
        fe.validate([HELLO], {"n": 2**32 - 1})
    assert built == []


def test_a_renamed_field_is_named_as_the_client_named_it() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    names = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO], {"max_tokens": 0}, field_prefix="", field_names=names)
    assert err.value.message == "max_completion_tokens must be an integer >= 1, got 0"
    assert err.value.param == "max_completion_tokens"
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO], {"max_tokens": 1, "logprobs": 21}, field_prefix="", field_names=names)
    assert (err.value.message, err.value.param) == ("top_logprobs must be at most 20, got 21", "top_logprobs")


def test_a_tiny_top_p_survives_the_wire_rounding() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    gen = fe.validate([HELLO], {"max_tokens": 1, "top_p": 1e-9})
    assert gen.sampling_params.top_p == 1e-9
    assert sampling_params_from_proto(gen.to_proto().sampling_params) == gen.sampling_params


def test_max_tokens_beyond_the_context_is_refused_as_vllm_does() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))  # context 64
    with pytest.raises(ServiceError) as err:
        fe.validate([HELLO] * 10, {"max_tokens": 55})
    assert err.value.message == (
        "sampling_params.max_tokens is too large: 55. This model's maximum context length is 64 "
        "tokens and your request has 10 input tokens (55 > 64 - 10)"
    )
    assert fe.validate([HELLO] * 10, {"max_tokens": 54}).max_tokens == 54  # exactly the context
    with pytest.raises(ServiceError, match=r"^max_completion_tokens is too large: 2147483647\."):
        fe.validate(
            [HELLO],
            {"max_tokens": 2**31 - 1},
            field_prefix="",
            field_names={"max_tokens": "max_completion_tokens"},
        )


def test_strings_are_bounded_and_must_be_valid_unicode() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    with pytest.raises(ServiceError) as err:
        fe.encode_text("Say \ud800.", "prompt")
    assert (err.value.message, err.value.param) == (
        "prompt: not valid Unicode (a lone surrogate at character 4)",
        "prompt",
    )
    with pytest.raises(ServiceError, match=r"^messages\[1\]\.content: not valid Unicode"):
        fe.encode_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}], "messages")
    with pytest.raises(ServiceError, match=r"^prompt: at most 1048576 characters$"):
        fe.encode_text("x" * (2**20 + 1), "prompt")
    with pytest.raises(ServiceError, match=r"^stop\[0\]: at most 256 characters$"):
        fe.validate([HELLO], {}, ["x" * 257], field_prefix="")
    with pytest.raises(ServiceError, match=r"^cache_salt: not valid Unicode"):
        fe.validate([HELLO], {}, cache_salt="\ud800")


def test_the_model_name_is_checked_and_never_echoed_unbounded() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    fe.check_model(None)  # omitted: the served model
    fe.check_model("tiny")
    with pytest.raises(ServiceError) as err:
        fe.check_model("")
    assert (err.value.code, err.value.param) == ("INVALID_ARGUMENT", "model")
    with pytest.raises(ServiceError) as err:
        fe.check_model("m" * 10_000)
    assert err.value.message == "model: at most 256 characters"
    with pytest.raises(ServiceError) as err:
        fe.check_model("gpt-4")
    assert (err.value.code, err.value.message) == (
        "NOT_FOUND",
        "model: 'gpt-4' is not served here (this server serves 'tiny')",
    )


def test_client_request_ids_are_labels_and_the_server_keys_by_its_own() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    a = fe.validate([HELLO], {"max_tokens": 1}, request_id="same#id/x")
    b = fe.validate([HELLO], {"max_tokens": 1}, request_id="same#id/x")
    assert a.label == b.label == "same#id/x"
    assert a.request_id != b.request_id
    assert all(set(g.request_id) <= set("0123456789abcdef") for g in (a, b))
    anonymous = fe.validate([HELLO], {"max_tokens": 1})
    assert anonymous.client_request_id == "" and anonymous.label == anonymous.request_id


def test_a_completions_batch_is_bounded() -> None:
    fe = frontend(FakeDispatcher([[[HELLO]]]))
    fe.check_batch(256, 4)
    with pytest.raises(ServiceError, match=r"^prompt: at most 256 prompts per request$"):
        fe.check_batch(257, 1)
    with pytest.raises(ServiceError, match=r"^n: 9 prompts × n=128 asks for 1152 completions, at most 1024"):
        fe.check_batch(9, 128)
