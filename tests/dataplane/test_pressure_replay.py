"""`pagedserve bench pressure`'s workload replayed through the scheduler alone (no model): the
token and block accounting the benchmark measures, exact, in a fraction of a second.

Why the CPU's default host pool is the device pool's bytes (dataplane/src/pagedserve/dataplane/engine/startup.py, plan_host_blocks): on
the benchmark's saturated replay (24 chat-trace requests, 6,065 tokens of KV demand on a
68-block device pool, SmolLM2 in fp32 at 48 MiB) a host pool of a quarter of the device pool
fills, and auto falls back to recomputing 10 % of the tokens; the same bytes as the device pool
take every victim and nothing is recomputed. These are the counts the benchmark measured on
the real model (benchmarks/README.md): greedy tokens do not change what the scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.benchmarks.pressure import build_workload
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.scheduler import Request, Scheduler

DEVICE_BLOCKS = 68  # 48 MiB of SmolLM2's fp32 KV (30 layers x 3 KV heads x 64 x 4 B x 2) in 16-token blocks
BLOCK_SIZE = 16
VOCAB = 49152


@dataclass(frozen=True)
class Replay:
    computed_tokens: int
    recomputed_tokens: int
    preemptions_swap: int
    preemptions_recompute: int
    blocks_swapped_out: int
    blocks_swapped_in: int

    @property
    def recomputed_share(self) -> float:
        return self.recomputed_tokens / self.computed_tokens


def replay(mode: str, host_blocks: int, num_requests: int = 24) -> Replay:
    """Submit everything at once and step to the end, as the benchmark does (its defaults:
    max_num_seqs 64, 2048 batched tokens, watermark 0.01, prefix caching on)."""
    host = BlockPool(host_blocks) if host_blocks else None
    kv = KVCacheManager(BlockPool(DEVICE_BLOCKS), BLOCK_SIZE, enable_prefix_caching=True, host_pool=host)
    config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, preemption_mode=mode, watermark=0.01
    )
    scheduler = Scheduler(kv, config, 8192)
    requests = []
    for i, (prompt, out_len) in enumerate(build_workload("chat", num_requests, 128, VOCAB, seed=0)):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        requests.append(Request(f"p{i}", prompt, params, eos_token_id=None))
        scheduler.add_request(requests[-1])
    computed = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        computed += out.num_batched_tokens
        token = 7 + len(requests)  # any token: ignore_eos, and random prompts make no prefix hits
        scheduler.update_from_output(out, {s.request.request_id: token for s in out.scheduled if s.samples})
        scheduler.check_integrity()
    needed = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in requests)
    assert kv.pool.num_free_blocks == DEVICE_BLOCKS
    return Replay(
        computed,
        computed - needed,
        scheduler.num_swap_preemptions,
        scheduler.num_recompute_preemptions,
        scheduler.num_blocks_swapped_out,
        scheduler.num_blocks_swapped_in,
    )


def test_recompute_only_redoes_14_percent() -> None:
    r = replay("recompute", 0)
    assert (r.recomputed_tokens, r.preemptions_swap, r.preemptions_recompute) == (986, 0, 8)
    assert round(r.recomputed_share, 3) == 0.140


def test_auto_with_a_quarter_size_host_pool_falls_back_to_recompute() -> None:
    r = replay("auto", DEVICE_BLOCKS // 4)
    assert (r.recomputed_tokens, r.preemptions_swap, r.preemptions_recompute) == (671, 5, 3)
    assert r.recomputed_share >= 0.05


def test_auto_with_the_default_host_pool_recomputes_nothing() -> None:
    """The CPU default: as many host blocks as device blocks (same block bytes)."""
    r = replay("auto", DEVICE_BLOCKS)
    assert (r.recomputed_tokens, r.preemptions_swap, r.preemptions_recompute) == (0, 8, 0)
    assert (r.blocks_swapped_out, r.blocks_swapped_in) == (97, 65)
    assert replay("auto", DEVICE_BLOCKS, num_requests=64).recomputed_tokens == 0  # the whole trace
