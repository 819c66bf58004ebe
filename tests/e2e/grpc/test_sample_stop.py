"""n > 1 with a stop string that one sample hits early, against real servers on the real
default model: the control plane (which matches stop strings) stops that sample on the data
plane at once, the others run on untouched, and the result reports "stop" for it.

What the data plane did is read from its own metrics: tokens generated, and samples finished
by reason. Had the stopped sample run on until the group's end (the behaviour before the
per-sample abort), it would have generated max_tokens and finished "length".
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.clients.python import AsyncGenerationClient, Completion
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.dataplane.server.engine_loop import EngineLoop
from tests.e2e.harness import engine_config, start_controlplane, start_dataplane, wait_idle

pytestmark = pytest.mark.real_model

PROMPT = "Write a short story about a cat who learns to fly."
MAX_TOKENS = 64
STOP_CHARS = 6  # length of the stop string cut out of a sample's text


def dataplane_counts(loop: EngineLoop) -> dict[str, float]:
    """Tokens the data plane generated, and samples it finished by reason, so far."""
    registry = loop.metrics.registry
    counts = {"generated": registry.get_sample_value("pagedserve_generation_tokens_total") or 0.0}
    for reason in ("stop", "length", "abort"):
        value = registry.get_sample_value("pagedserve_request_success_total", {"finished_reason": reason})
        counts[reason] = value or 0.0
    return counts


def early_stop_string(samples: list[Completion]) -> tuple[int, str]:
    """(k, s): a string s that sample k's text holds early and no other sample's text holds,
    so that with stop=[s] sample k alone stops, a few tokens in."""
    for k, sample in enumerate(samples):
        others = [c.text for j, c in enumerate(samples) if j != k]
        for start in range(8, 40):
            s = sample.text[start : start + STOP_CHARS]
            early = len(s) == STOP_CHARS and s.strip() and sample.text.index(s) == start
            if early and not any(s in text for text in others):
                return k, s
    raise AssertionError(f"no sample-specific stop string in {[c.text for c in samples]}")


@pytest.mark.parametrize("n", [2, 4])
def test_a_sample_that_hits_its_stop_string_stops_on_the_data_plane(n: int) -> None:
    params = dict(n=n, max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)

    async def run() -> None:
        dp = await start_dataplane(engine_config(DEFAULT_MODEL, num_blocks=256, max_model_len=2048))
        cp = await start_controlplane(DEFAULT_MODEL, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                free = await client.generate(PROMPT, **params)
                assert [c.completion_tokens for c in free] == [MAX_TOKENS] * n
                k, stop = early_stop_string(free)
                await wait_idle(dp.address)
                before = dataplane_counts(dp.loop)

                stopped = await client.generate(PROMPT, stop=[stop], **params)

                # The client's result: sample k stops at its stop string, the others are untouched.
                assert [c.index for c in stopped] == list(range(n))
                assert stopped[k].finish_reason == "stop" and stopped[k].stop_string == stop
                assert stopped[k].text == free[k].text[: free[k].text.index(stop)]
                seen = stopped[k].completion_tokens
                assert 0 < seen < MAX_TOKENS
                others = [j for j in range(n) if j != k]
                assert [stopped[j].finish_reason for j in others] == ["length"] * (n - 1)
                assert [stopped[j].token_ids for j in others] == [free[j].token_ids for j in others]

                # The data plane's account: sample k ended by an abort (its siblings by length),
                # having generated fewer than max_tokens, and every block came back.
                idle = await wait_idle(dp.address)
                after = dataplane_counts(dp.loop)
                assert after["abort"] - before["abort"] == 1
                assert after["length"] - before["length"] == n - 1
                assert after["stop"] == before["stop"]
                generated_k = after["generated"] - before["generated"] - (n - 1) * MAX_TOKENS
                assert seen <= generated_k < MAX_TOKENS
                assert idle.snapshot.stats.num_aborted_requests == 0  # one sample, not the request
                assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
            dp.loop.engine.check_integrity()  # type: ignore[attr-defined]
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())
