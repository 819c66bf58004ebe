"""The model-free scheduler harness that the property suites share.

`test_scheduler_properties.py` drives one device pool (KV events, tenants, refusals);
`test_swap_properties.py` adds a host pool, swaps and n > 1 groups. Both build prompts from a
few shared prefixes with random tails, keep a shadow of the KV (for every slot a step writes,
the token prefix and salt its KV belongs to) and run the same checks on it: a scheduled
request reads only its own prefix, and a step writes only into private, uncached blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import currently_in_test_context
from hypothesis import event as hypothesis_event

from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager, cdiv
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

EOS = 2
VOCAB = 8

Slot = tuple[int, int]  # (block id, offset)
Content = tuple[str | None, int]  # (salt, prefix id)


def event(name: str) -> None:
    """Hypothesis statistics when under @given; the harness also runs in plain tests."""
    if currently_in_test_context():
        hypothesis_event(name)


def shared_prefix_prompt(prompt_len: int, family: int, diverge_at: int | None, tail_seed: int) -> list[int]:
    """`family`'s shared prefix, then (from `diverge_at`) a tail drawn from two tokens, so that
    prompts share blocks, partly share them, or not at all."""
    rng = random.Random(tail_seed)
    start = prompt_len if diverge_at is None else min(diverge_at, prompt_len)
    return [100 * (family + 1) + i for i in range(start)] + [
        rng.choice((50, 51)) for _ in range(prompt_len - start)
    ]


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


class ShadowKV:
    """The scheduler under test, its device pool, and what the model's KV would hold."""

    def __init__(self, block_size: int, pool: BlockPool, kv: KVCacheManager, scheduler: Scheduler) -> None:
        self.block_size = block_size
        self.pool = pool
        self.kv = kv
        self.s = scheduler
        self.submitted: list[Request] = []
        self.outputs: dict[int, list[int]] = {}  # id(request) -> the tokens the harness fed it
        self.num_steps = 0
        self.device: dict[Slot, Content] = {}
        self.prefix_ids: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id
        self.request_prefix_ids: dict[int, list[int]] = {}  # id(request) -> prefix id per position

    def prefix_ids_of(self, r: Request) -> list[int]:
        """Interned ids of each token prefix of `r`: equal ids <=> equal token prefixes."""
        ids = self.request_prefix_ids.setdefault(id(r), [])
        for token in r.all_token_ids[len(ids) :]:
            key = (ids[-1] if ids else -1, token)
            ids.append(self.prefix_ids.setdefault(key, len(self.prefix_ids)))
        return ids

    def assert_holds_prefix(
        self, r: Request, table: list[int], shadow: dict[Slot, Content], where: str, start: int = 0
    ) -> None:
        """The slots of `table` hold `r`'s own computed prefix from position `start` on."""
        bs = self.block_size
        pids = self.prefix_ids_of(r)
        for p in range(start, r.num_computed_tokens):
            slot = (table[p // bs], p % bs)
            assert shadow.get(slot) == (r.cache_salt, pids[p]), f"{r}: {where} KV of position {p} is wrong"

    def write_kv(self, r: Request, num_new_tokens: int) -> None:
        """The step computes `r`'s next `num_new_tokens`: only into blocks it alone holds and
        that no hash names yet."""
        bs = self.block_size
        pids = self.prefix_ids_of(r)
        for p in range(r.num_computed_tokens, r.num_computed_tokens + num_new_tokens):
            block = self.pool.blocks[r.block_table[p // bs]]
            assert block.ref_cnt == 1, f"{r} writes into shared {block}"
            assert block.block_hash is None, f"{r} writes into cached {block}"
            self.device[(block.block_id, p % bs)] = (r.cache_salt, pids[p])

    def check_step_shape(
        self, out: SchedulerOutput, had_work: bool, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        """What any step obeys: never empty while work remains (never work out of nothing),
        within the token budget and max_num_seqs, each request once, each scheduled request
        running with exactly the blocks its tokens need."""
        scheduled = [x.request for x in out.scheduled]
        assert out.is_empty == (not had_work), "an empty step while work remains (or work from nothing)"
        assert out.num_batched_tokens <= max_num_batched_tokens
        assert len(out.scheduled) <= max_num_seqs and len(self.s.running) <= max_num_seqs
        assert len({id(r) for r in scheduled}) == len(scheduled)
        for x in out.scheduled:
            r = x.request
            assert x.num_new_tokens >= 1 and r.status is RequestStatus.RUNNING
            assert r.num_computed_tokens + x.num_new_tokens <= r.num_tokens
            assert len(r.block_table) == cdiv(r.num_computed_tokens + x.num_new_tokens, self.block_size)

    def check_running(self, others: list[Request]) -> None:
        """Between steps, every running request holds the blocks of its computed tokens and has
        a sampled token pending; it and `others` (waiting, swapped) kept every token fed to them."""
        for r in self.s.running:
            assert len(r.block_table) == cdiv(r.num_computed_tokens, self.block_size)
            assert r.num_computed_tokens < r.num_tokens
        for r in [*self.s.running, *others]:
            assert r.output_token_ids == self.outputs[id(r)], f"{r} lost tokens"

    def device_holders(self) -> Counter[int]:
        """How many running requests hold each device block; exactly the referenced blocks."""
        holders: Counter[int] = Counter(b for r in self.s.running for b in r.block_table)
        assert sorted(holders) == sorted(b.block_id for b in self.pool.blocks if b.ref_cnt > 0)
        return holders

    def check_all_free(self) -> None:
        """After a drain: nothing held, every block free, every accepted request finished."""
        s = self.s
        assert not s.running and not s.waiting and not s.requests
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)  # every block free or cached-unreferenced
        self.pool.check_integrity()
        for r in self.submitted:
            assert r.status.finished and r.block_table == []
        s.check_integrity()
