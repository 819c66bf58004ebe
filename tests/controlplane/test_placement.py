"""Placement and failover as pure decisions over link snapshots: no servers, no event loop.

Also the admission rule both planes share (`pagedserve.common.admission_rules`), and the
Dispatcher's side of it: the snapshot it takes of a link and the reservation it makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pagedserve.common.admission_rules import refusal
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.controlplane.config import ControlPlaneConfig, RoutingWeights
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.admission import HeldBack
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.routing.link_snapshots import prompt_hashes
from pagedserve.controlplane.routing.placement import (
    NO_DATAPLANE,
    WAIT,
    WAIT_HELD_BACK,
    LinkSnapshot,
    Placement,
    Refusal,
    plan_placement,
    reservation_refusal,
    retry_on_other,
)
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

W = RoutingWeights()
TOO_LONG = (
    "prompt has {n} tokens, but max_model_len is {m} "
    "(the prompt must leave room for at least one generated token)"
)
TOO_BIG = (
    "prompt plus max_tokens needs {need} KV blocks but the whole pool has only {pool}; "
    "lower max_tokens or shorten the prompt"
)


def snap(address: str = "a", **kw: Any) -> LinkSnapshot:
    """An idle, healthy data plane: 64 blocks of 16 tokens, context 1024, nothing cached."""
    base: dict[str, Any] = dict(
        healthy=True,
        draining=False,
        block_size=16,
        num_blocks=64,
        max_model_len=1024,
        max_num_seqs=8,
        free_blocks=64,
        reserved_blocks=0,
        total_blocks=64,
        prompt_blocks=0,
        cached_blocks=0,
    )
    base.update(kw)
    return LinkSnapshot(address=address, **base)


def req(prompt_tokens: int = 40, max_tokens: int = 16, n: int = 1, rid: str = "r") -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    return GenerationRequest(rid, tuple(range(3, 3 + prompt_tokens)), params)


def plan(request: GenerationRequest, *links: LinkSnapshot, reserve: int = 1, **kw: Any) -> object:
    return plan_placement(request, links, W, reserve, **kw)


# -- where it runs ---------------------------------------------------------------------------


def test_the_data_plane_caching_the_prompt_wins_and_reserves_only_the_uncached_blocks() -> None:
    # 40 tokens: 3 blocks, 2 of them full (cacheable); "hot" caches both.
    hot = snap("hot", prompt_blocks=2, cached_blocks=2, in_flight=2, num_running=2)
    cold = snap("cold", prompt_blocks=2)
    # need = 3 prompt blocks - 2 cached + 1 decode-reserve block
    assert plan(req(40), cold, hot) == Placement("hot", need_blocks=2, cached_blocks=2)


def test_without_a_cached_prefix_the_least_loaded_wins_and_ties_go_to_the_lower_address() -> None:
    assert plan(req(), snap("a", in_flight=3), snap("b")) == Placement("b", 4, 0)
    assert plan(req(), snap("b"), snap("a")) == Placement("a", 4, 0)


def test_every_sample_reserves_its_decode_blocks() -> None:
    assert plan(req(40, n=3), snap(), reserve=2) == Placement("a", 3 + 3 * 2, 0)


# -- refused: it can never run ---------------------------------------------------------------


def test_a_prompt_filling_the_context_is_refused_with_the_shared_message() -> None:
    refused = plan(req(1024), snap(max_model_len=1024))
    assert refused == Refusal("INVALID_ARGUMENT", TOO_LONG.format(n=1024, m=1024))


def test_more_blocks_than_the_whole_pool_is_refused_even_when_the_pool_is_idle() -> None:
    # 100 + 100 tokens in 16-token blocks: 13 blocks, the pool has 8.
    refused = plan(req(100, max_tokens=100), snap(num_blocks=8, free_blocks=8, total_blocks=8))
    assert refused == Refusal("INVALID_ARGUMENT", TOO_BIG.format(need=13, pool=8))


def test_block_need_counts_only_up_to_max_model_len() -> None:
    # max_tokens far beyond the context: 128 tokens at most = 8 blocks = the whole pool.
    small = snap(num_blocks=8, free_blocks=8, total_blocks=8, max_model_len=128)
    assert isinstance(plan(req(100, max_tokens=10_000), small), Placement)


def test_a_data_plane_that_can_never_run_it_is_skipped_for_one_that_can() -> None:
    short = snap("a", max_model_len=64)  # would win the tie on address
    assert plan(req(100), short, snap("b")) == Placement("b", 8, 0)


def test_when_every_data_plane_refuses_the_roomiest_ones_reason_is_given() -> None:
    short = snap("a", max_model_len=64, num_blocks=1000, total_blocks=1000, free_blocks=1000)
    small = snap("b", max_model_len=4096, num_blocks=8, total_blocks=8, free_blocks=8)
    assert plan(req(300), short, small) == Refusal("INVALID_ARGUMENT", TOO_BIG.format(need=20, pool=8))
    assert plan(req(5000), short, small) == Refusal("INVALID_ARGUMENT", TOO_LONG.format(n=5000, m=4096))


def test_the_rule_itself() -> None:
    assert refusal(7, 5, block_size=4, num_blocks=2, max_model_len=8) is None  # capped at 8 tokens
    assert refusal(8, 1, block_size=4, num_blocks=2, max_model_len=8) == TOO_LONG.format(n=8, m=8)
    assert refusal(4, 5, block_size=4, num_blocks=2, max_model_len=100) == TOO_BIG.format(need=3, pool=2)
    assert refusal(4, 4, block_size=4, num_blocks=2, max_model_len=100) is None  # exactly the pool


# -- waits: it could run later ---------------------------------------------------------------


def test_a_request_that_fits_nowhere_now_but_could_later_waits() -> None:
    busy = snap("a", free_blocks=3)  # needs 4
    reserved = snap("b", free_blocks=64, reserved_blocks=61)  # this replica's other admissions
    assert plan(req(40), busy, reserved) is WAIT
    assert plan(req(40), busy, snap("c", free_blocks=4)) == Placement("c", 4, 0)


def test_a_tenant_at_its_dispatch_cap_where_the_blocks_are_is_held_back_not_waiting() -> None:
    # A full batch of 8: 4 of the tenant's requests may wait there (router.MIN_PENDING).
    capped = snap("c", num_running=8, pending=4, pending_tokens=256, pending_token_limit=4096)
    assert plan(req(40), capped) is WAIT_HELD_BACK
    assert plan(req(40), snap("a", free_blocks=3), capped) is WAIT_HELD_BACK  # some data plane has room
    full = snap("c", free_blocks=3, num_running=8, pending=4, pending_tokens=256, pending_token_limit=4096)
    assert plan(req(40), full) is WAIT  # blocks missing as well: an ordinary wait
    roomy = snap("c", num_running=8, pending=4, pending_token_limit=4096, share_slots=5)
    assert plan(req(40), roomy) == Placement("c", 4, 0)  # its share of the batch leaves it room


# -- which data planes count -----------------------------------------------------------------


def test_draining_unhealthy_and_excluded_data_planes_are_skipped() -> None:
    links = (snap("a", draining=True), snap("b", healthy=False), snap("c"), snap("d"))
    assert plan(req(), *links) == Placement("c", 4, 0)
    assert plan(req(), *links, exclude=frozenset({"c"})) == Placement("d", 4, 0)


def test_no_usable_data_plane_is_unavailable() -> None:
    links = (snap("a", draining=True), snap("b", healthy=False), snap("c"))
    assert plan(req(), *links, exclude=frozenset({"c"})) == Refusal("UNAVAILABLE", NO_DATAPLANE)
    assert plan(req()) == Refusal("UNAVAILABLE", NO_DATAPLANE)


# -- failover --------------------------------------------------------------------------------


def test_a_request_that_streamed_nothing_moves_to_another_data_plane() -> None:
    exclude = retry_on_other("a", "data plane a went away", streamed=False, exclude=frozenset())
    assert exclude == frozenset({"a"})
    assert plan(req(), snap("a"), snap("b"), exclude=exclude) == Placement("b", 4, 0)
    assert retry_on_other("b", "gone", streamed=False, exclude=exclude) == frozenset({"a", "b"})


def test_a_request_that_already_streamed_is_not_retried() -> None:
    decision = retry_on_other("a", "data plane a went away (UNAVAILABLE)", streamed=True, exclude=frozenset())
    assert decision == Refusal(
        "UNAVAILABLE", "data plane a went away (UNAVAILABLE) while streaming; retry the request"
    )


def test_with_every_data_plane_lost_the_retry_is_unavailable() -> None:
    exclude = retry_on_other("a", "gone", streamed=False, exclude=frozenset())
    assert plan(req(), snap("a"), exclude=exclude) == Refusal("UNAVAILABLE", NO_DATAPLANE)


# -- the Dispatcher's side: snapshot a link, carry the plan out ------------------------------


def _link(
    dispatcher: Dispatcher, address: str, free: int, hashes: Sequence[bytes] = ()
) -> DataPlaneConnection:
    link = DataPlaneConnection(address, dispatcher.index, on_change=lambda: None)
    link.info = dataplane_pb2.DataPlaneInfo(
        block_size=16,
        num_blocks=64,
        max_model_len=1024,
        max_num_seqs=8,
        prefix_hash_seed="seed",
        enable_prefix_caching=True,
    )
    link.budget.report(free, 64)
    link.healthy = True
    dispatcher.index.load_snapshot(address, hashes, 0)
    dispatcher.connections[address] = link
    return link


def test_the_dispatcher_snapshots_its_links_and_reserves_the_planned_blocks() -> None:
    dispatcher = Dispatcher(ControlPlaneConfig(dataplanes=("a:1",)))
    request = req(40, rid="r1")
    hashes = prompt_hashes(request)
    cold = _link(dispatcher, "cold:1", free=64)
    hot = _link(dispatcher, "hot:1", free=64, hashes=hashes(16, "seed"))
    assert [s.cached_blocks for s in dispatcher.snapshots(hashes)] == [0, 2]
    reservation = dispatcher._place(request, frozenset(), hashes)
    assert reservation is not None and not isinstance(reservation, HeldBack)
    assert (reservation.connection, reservation.need_blocks, reservation.cached_blocks) == (hot, 2, 2)
    assert hot.budget.reserved_blocks == 2 and cold.budget.reserved_blocks == 0
    [hot_snapshot] = [s for s in dispatcher.snapshots(hashes) if s.address == "hot:1"]
    assert hot_snapshot.available_blocks == 62


def test_the_dispatcher_waits_or_raises_as_planned() -> None:
    dispatcher = Dispatcher(ControlPlaneConfig(dataplanes=("a:1",)))
    _link(dispatcher, "a:1", free=3)
    request = req(40)
    assert dispatcher._place(request, frozenset(), prompt_hashes(request)) is None
    too_long = req(2000)
    with pytest.raises(ServiceError) as err:
        dispatcher._place(too_long, frozenset(), prompt_hashes(too_long))
    assert (err.value.code, err.value.message) == ("INVALID_ARGUMENT", TOO_LONG.format(n=2000, m=1024))


# -- a reservation that can never be made (issue 12) ------------------------------------------


def test_n_samples_whose_reservation_exceeds_the_whole_pool_are_refused_at_once() -> None:
    # 40 tokens: 3 prompt blocks + 2 per sample; 31 samples reserve 65 > 64 blocks. Before,
    # this waited (WAIT) until its deadline however empty the pool was.
    refused = plan(req(40, n=31), snap(), reserve=2)
    assert refused == Refusal(
        "INVALID_ARGUMENT",
        "the request's 31 sample(s) reserve 65 KV blocks (3 for the prompt + 2 per sample) "
        "but the whole pool has only 64; lower n",
        "n",
    )
    assert plan(req(40, n=30), snap(), reserve=2) == Placement("a", 63, 0)  # 63 fits an idle pool


def test_the_reservation_rule_ignores_the_cache_so_it_never_depends_on_eviction() -> None:
    # Cached prefix blocks reduce what is reserved now, not whether it can ever be reserved.
    cached = snap(prompt_blocks=2, cached_blocks=2)
    assert isinstance(plan(req(40, n=31), cached, reserve=2), Refusal)
    assert reservation_refusal(40, 30, block_size=16, num_blocks=64, decode_reserve_blocks=2) is None
    assert reservation_refusal(40, 10, block_size=16, num_blocks=64, decode_reserve_blocks=0) is None
