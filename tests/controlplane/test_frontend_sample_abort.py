"""n > 1 with stop strings: a sample that matches its stop string is stopped on the data plane
too (one sample's abort), while its siblings run on. Over a fake dispatcher, and the link's
wire command; tests/e2e/grpc/test_sample_stop.py runs it against real servers."""

from __future__ import annotations

import asyncio

from pagedserve.controlplane.frontend import CompletionDone
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection, RequestHandle
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.protos.pagedserve.v1 import dataplane_pb2
from tests.controlplane.test_frontend import (
    ARE,
    BANG,
    COMMA,
    HELLO,
    HOW,
    QUESTION,
    WORLD,
    YOU,
    FakeDispatcher,
    dones,
    frontend,
    run,
    texts,
)


class SampleAbortingDispatcher(FakeDispatcher):
    """Records the samples the frontend asks to stop. (The stopped sample's later events, here
    its scripted tokens and finish, are what the frontend must drop.)"""

    def __init__(self, samples: list[list[list[int]]]) -> None:
        super().__init__(samples)
        self.aborted_samples: list[tuple[str, int]] = []

    def abort_sample(self, request_id: str, index: int) -> bool:
        self.aborted_samples.append((request_id, index))
        return True


def test_a_sample_matching_its_stop_string_is_aborted_alone() -> None:
    dispatcher = SampleAbortingDispatcher(
        [[[HELLO], [COMMA], [WORLD], [BANG], [HOW]], [[HOW], [ARE], [YOU], [QUESTION], [BANG]]]
    )
    fe = frontend(dispatcher)
    gen = fe.validate([BANG], {"max_tokens": 5, "n": 2, "seed": 1}, ["world"], request_id="r1")
    events = run(fe, gen)
    assert dispatcher.aborted_samples == [(gen.request_id, 0)]  # once, when it matched
    assert texts(events) == {0: "Hello, ", 1: " How are you?!"}
    assert {i: (d.finish_reason, d.stop_string, d.completion_tokens) for i, d in dones(events).items()} == {
        0: ("stop", "world", 3),
        1: ("length", None, 5),
    }
    assert dispatcher.closed_early is False  # the request ran to its end: no whole-request abort


def test_the_last_sample_to_stop_ends_the_request_without_a_sample_abort() -> None:
    dispatcher = SampleAbortingDispatcher([[[HELLO], [WORLD], [BANG]], [[HOW], [ARE], [WORLD], [YOU]]])
    fe = frontend(dispatcher)
    gen = fe.validate([BANG], {"max_tokens": 4, "n": 2, "seed": 1}, [" world"], request_id="r2")
    events = run(fe, gen)
    assert dispatcher.aborted_samples == [(gen.request_id, 0)]
    assert [(d.index, d.finish_reason) for d in events if isinstance(d, CompletionDone)] == [
        (0, "stop"),
        (1, "stop"),
    ]
    assert dispatcher.closed_early  # the last one closes the request: what still runs is aborted


def link_with(
    abort_sample: bool,
) -> tuple[DataPlaneConnection, asyncio.Queue[dataplane_pb2.ConnectRequest | None]]:
    """A link as an open stream to a data plane has it, with request "r" in flight."""
    link = DataPlaneConnection("dp:1", PrefixIndex(), on_change=lambda: None)
    link.info = dataplane_pb2.DataPlaneInfo(dataplane_id="dp", abort_sample=abort_sample)
    link.healthy = True
    outgoing: asyncio.Queue[dataplane_pb2.ConnectRequest | None] = asyncio.Queue()
    link._outgoing = outgoing
    link.handles["r"] = RequestHandle("r", link)
    return link, outgoing


def test_the_link_sends_a_sample_abort_only_to_a_data_plane_that_honours_it() -> None:
    link, outgoing = link_with(abort_sample=True)
    assert link.abort_sample("r", 2)
    command = outgoing.get_nowait()
    assert command is not None and command.WhichOneof("command") == "abort"
    assert command.abort.request_id == "r" and command.abort.HasField("index") and command.abort.index == 2
    assert "r" in link.handles  # the request itself runs on
    assert not link.abort_sample("other", 0) and outgoing.empty()  # not in flight here

    # The whole request's abort leaves the index unset: the data plane tells the two apart by it.
    link.abort("r")
    whole = outgoing.get_nowait()
    assert whole is not None and whole.abort.request_id == "r" and not whole.abort.HasField("index")

    older, outgoing = link_with(abort_sample=False)  # it would abort the whole request
    assert not older.abort_sample("r", 0) and outgoing.empty()
