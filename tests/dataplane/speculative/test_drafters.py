"""The drafters, the config and the draft-length policy: exact proposals, no model."""

from __future__ import annotations

import pytest

from pagedserve.dataplane.speculative.config import SpeculativeConfig
from pagedserve.dataplane.speculative.ngram import NgramDrafter
from pagedserve.dataplane.speculative.policy import Acceptance, StepCost, draft_lengths
from pagedserve.dataplane.speculative.suffix import SuffixDrafter


def test_ngram_proposes_the_continuation_of_the_latest_longest_match() -> None:
    drafter = NgramDrafter(1, 3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # [5, 6, 7] ended last at position 8 (before the suffix itself): its continuation follows.
    assert drafter.propose("r", tokens, 3) == [1, 2, 5]
    # Appending extends the index incrementally: [7, 1] is new, [1] was seen at position 8.
    tokens += [1]
    assert drafter.propose("r", tokens, 2) == [2, 5]
    assert drafter.propose("r", [3, 4], 4) == []  # another request: nothing seen yet
    drafter.finished("r", tokens, 4)
    assert "r" not in drafter._indexes


def test_ngram_respects_min_n() -> None:
    drafter = NgramDrafter(2, 2)
    assert drafter.propose("r", [1, 2, 3, 9, 2], 3) == []  # only a 1-token match exists
    assert drafter.propose("s", [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]


def test_suffix_follows_the_most_frequent_continuation_while_likely() -> None:
    drafter = SuffixDrafter(depth=3, min_probability=0.5, cache_requests=2)
    # After [1, 2]: 3 twice, 4 once. After [2, 3]: always 1 ...
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 0, 1, 2]
    draft = drafter.propose("r", tokens, 4)
    assert draft[0] == 3  # share 2/3 >= 0.5
    # A stricter threshold stops at once: 2/3 < 0.9.
    assert SuffixDrafter(3, 0.9, 0).propose("r", tokens, 4) == []


def test_suffix_learns_from_finished_outputs_and_forgets_old_ones() -> None:
    drafter = SuffixDrafter(depth=2, min_probability=0.0, cache_requests=1)
    drafter.finished("a", [9, 9, 10, 11, 12], num_prompt_tokens=2)  # output [10, 11, 12]
    assert drafter.propose("b", [7, 10], 2) == [11, 12]
    drafter.finished("c", [9, 20, 21], num_prompt_tokens=1)  # evicts a's output
    assert drafter.propose("d", [7, 10], 2) == []
    assert drafter.propose("e", [8, 20], 1) == [21]
    assert not drafter._shared.get((10,))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{", "speculative_config is not valid JSON"),
        ("[]", "speculative_config must be a JSON object"),
        ('{"num_speculative_tokens": 3}', "speculative_config.method is required"),
        ('{"method": "eagle"}', "speculative_config.method must be one of ngram, suffix"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "speculative_config.num_speculative_tokens"),
        (
            '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min must be <=",
        ),
        ('{"method": "ngram", "k": 2}', "speculative_config has unknown field(s) k"),
        ('{"method": "suffix", "suffix_min_probability": 2}', "speculative_config.suffix_min_probability"),
        ('{"method": "ngram", "adaptive": "yes"}', "speculative_config.adaptive must be true or false"),
    ],
)
def test_bad_configs_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(text)


def test_a_good_config_parses() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4}'
    )
    assert (
        config.method,
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
    ) == (
        "ngram",
        6,
        2,
        4,
    )


def test_drafts_pay_at_one_stream_and_shrink_as_the_batch_grows() -> None:
    cost = (0.030, 0.002)  # a step: 30 ms fixed, 2 ms per token
    rates = {f"r{i}": 0.6 for i in range(32)}
    one = draft_lengths({"r0": 8}, {"r0": 0.6}, decoding=1, cost=cost)
    # A draft must yield MARGIN (1.5) times its cost's share: the 3rd yields 0.6**3 = 0.216
    # tokens for 2 ms against 1.96 tokens in 36 ms so far (0.108 / ms > 1.5 x 0.054 / ms); the
    # 4th, 0.130 for 2 ms against 2.18 in 38 ms (0.065 / ms < 1.5 x 0.057 / ms): not taken.
    assert one == {"r0": 3}
    many = draft_lengths({rid: 8 for rid in rates}, rates, decoding=32, cost=cost)
    assert max(many.values()) < 8
    assert sum(many.values()) < sum(one.values()) * 32
    # Nearly useless drafts are never taken at a large batch.
    assert draft_lengths({"r0": 4}, {"r0": 0.05}, decoding=32, cost=cost) == {"r0": 0}


def test_step_cost_fits_a_line_once_step_sizes_differ() -> None:
    cost = StepCost(decay=1.0)
    assert cost.line() is None
    cost.observe(4, 0.030 + 4 * 0.002)
    fixed, per_token = cost.line() or (0.0, 0.0)
    assert per_token == pytest.approx(fixed / 8)  # one size seen: the prior share
    cost.observe(12, 0.030 + 12 * 0.002)
    assert cost.line() == pytest.approx((0.030, 0.002))


def test_acceptance_follows_each_request_and_recovers_when_idle() -> None:
    acceptance = Acceptance()
    start = acceptance.rate("r")
    acceptance.verified("r", drafted=4, accepted=0)
    low = acceptance.rate("r")
    assert low < start
    acceptance.verified("s", drafted=4, accepted=4)
    assert acceptance.rate("s") > start
    for _ in range(50):
        acceptance.idle("r")
    assert acceptance.rate("r") == pytest.approx(acceptance.overall, abs=0.05)
    acceptance.forget("r")
    assert acceptance.rate("r") == acceptance.overall


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "eagle"}', "speculative_config.method must be one of ngram, suffix, got 'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative_config.num_speculative_tokens"),
        ("{not json", "speculative_config is not valid JSON"),
    ],
)
def test_serve_refuses_a_bad_config_at_start_naming_the_field(value: str, message: str) -> None:
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", "--speculative-config", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert message in run.stderr
