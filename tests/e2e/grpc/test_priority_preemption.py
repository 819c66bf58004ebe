"""Priorities end to end on a tiny model, over gRPC through both planes: with the data plane's
batch full of priority-10 streams, a priority-0 request is placed at once (the control plane
does not queue it behind them), preempts one of them on the data plane for its seat and
finishes while they still run; the preempted stream then finishes with the greedy tokens it
gave alone. An out-of-range priority is INVALID_ARGUMENT naming the field.

The batch (max_num_seqs), not the pool, is what is full: the pool holds every stream at its
longest, so no stream is ever preempted for blocks and the one preemption is the priority's
(a pool full of growing streams preempts among them, and whether the urgent request then
finds free blocks is a race; tests/dataplane/test_scheduler_priorities.py covers blocks).

Its time to first token, in the data plane's steps, is printed (run with -s), not asserted.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.clients.python import AsyncGenerationClient, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from tests.e2e.harness import engine_config, get_state, start_controlplane, start_dataplane, wait_idle

STREAMS = 4  # = max_num_seqs
GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = 480  # tokens per stream: 4 × 32 blocks of 16 at their longest, against a pool of 160


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_a_priority_0_request_preempts_a_batch_full_of_priority_10_streams(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=160, max_num_seqs=STREAMS))
        cp = await start_controlplane(tiny, [dp.address], decode_reserve_blocks=0)
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate([5, 6, 7], max_tokens=2, priority=1_000_001)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (err.value.details() or "").startswith("priority must be in")

                alone = [
                    (await client.generate(prompt(i, 24), max_tokens=LONG, **GREEDY))[0].token_ids
                    for i in range(STREAMS)
                ]
                urgent_alone = (await client.generate(prompt(99, 20), max_tokens=8, **GREEDY))[0].token_ids

                gaps: list[float] = []

                async def stream(i: int) -> list[int]:
                    tokens: list[int] = []
                    last = None
                    async for item in client.generate_stream(
                        prompt(i, 24), max_tokens=LONG, priority=10, **GREEDY
                    ):
                        if isinstance(item, StreamChunk):
                            tokens += item.token_ids
                            now = time.monotonic()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                    return tokens

                streams = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
                for _ in range(2000):  # until all of them run (and so fill the batch)
                    stats = (await get_state(dp.address)).snapshot.stats
                    if stats.num_running == STREAMS and stats.num_preemptions == 0:
                        break
                    await asyncio.sleep(0.005)
                else:
                    pytest.fail(f"the streams never filled the batch: {stats}")
                preempted_before = stats.num_preemptions

                started = time.monotonic()
                urgent = await client.generate(prompt(99, 20), max_tokens=8, priority=0, **GREEDY)
                ttft = urgent[0].time_to_first_token_seconds
                elapsed = time.monotonic() - started
                still_running = sum(not t.done() for t in streams)
                results = await asyncio.gather(*streams)

            assert urgent[0].token_ids == urgent_alone
            assert still_running > 0  # it did not wait for the streams to end
            assert results == alone  # preempted or not, each stream's tokens are its own
            loop_metric = dp.loop.metrics.registry.get_sample_value
            assert loop_metric("pagedserve_num_priority_preemptions_total") == 1
            after = (await wait_idle(dp.address)).snapshot.stats
            assert after.num_preemptions == preempted_before + 1
            assert after.free_blocks == after.total_blocks
            step = statistics.median(gaps)
            print(
                f"\npriority 0 over a full batch: TTFT {ttft * 1000:.1f} ms = {ttft / step:.1f} median "
                f"decode steps ({step * 1000:.1f} ms), done in {elapsed * 1000:.0f} ms; "
                f"{loop_metric('pagedserve_num_priority_preemptions_total'):.0f} priority preemption(s)"
            )
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())
