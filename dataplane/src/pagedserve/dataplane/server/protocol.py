"""The data plane's wire encodings of engine state (KV events, finish reasons, pool stats).
Imports no torch."""

from __future__ import annotations

from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.protocol import FINISH_REASON_BY_NAME, pooling_params_from_proto
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.dataplane.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecord
from pagedserve.dataplane.request import RequestStatus
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2


def pooling_of(command: dataplane_pb2.SubmitCommand) -> PoolingParams | None:
    """A submit's pooling parameters when it is a pooling request; raises InvalidField (a
    ValueError) for an unknown pooling type."""
    return pooling_params_from_proto(command.pooling) if command.HasField("pooling") else None


def finish_reason_to_proto(status: RequestStatus) -> common_pb2.FinishReason.ValueType:
    """The wire finish reason of a request's status; a request that ends unfinished was aborted."""
    return FINISH_REASON_BY_NAME.get(status.value, common_pb2.FINISH_REASON_ABORT)


def kv_event_to_proto(record: KVEventRecord) -> dataplane_pb2.KVEvent:
    event = record.event
    if isinstance(event, BlockStored):
        return dataplane_pb2.KVEvent(
            seq=record.seq,
            stored=dataplane_pb2.BlockStoredEvent(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash or b""
            ),
        )
    if isinstance(event, BlockRemoved):
        return dataplane_pb2.KVEvent(
            seq=record.seq, removed=dataplane_pb2.BlockRemovedEvent(block_hashes=list(event.block_hashes))
        )
    if isinstance(event, AllBlocksCleared):
        return dataplane_pb2.KVEvent(seq=record.seq, cleared=dataplane_pb2.AllBlocksClearedEvent())
    raise TypeError(f"unknown KV event {event!r}")


def pool_stats_to_proto(stats: EngineStats, draining: bool, num_aborted: int) -> dataplane_pb2.PoolStats:
    return dataplane_pb2.PoolStats(
        total_blocks=stats.total_blocks,
        free_blocks=stats.free_blocks,
        cached_blocks=stats.cached_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        prefix_cache_queries=stats.prefix_cache.queries,
        prefix_cache_hits=stats.prefix_cache.hits,
        num_preemptions=stats.num_preemptions,
        draining=draining,
        num_aborted_requests=num_aborted,
        num_preemptions_swap=stats.num_preemptions_swap,
        num_preemptions_recompute=stats.num_preemptions_recompute,
        blocks_swapped_out=stats.blocks_swapped_out,
        blocks_swapped_in=stats.blocks_swapped_in,
        swap_seconds=stats.swap_seconds,
        num_swapped=stats.num_swapped,
        host_total_blocks=stats.host_total_blocks,
        host_free_blocks=stats.host_free_blocks,
    )
