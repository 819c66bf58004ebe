"""vLLM's sampling extras in the sampler and the engine: allowed_token_ids, min_tokens and bad
words mask exactly the tokens they name, logprobs stay those of the raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.common.sampling_params import MAX_ALLOWED_TOKEN_IDS, InvalidField
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.runner.sampler import _adjusted, sample

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]])
EOS = 1


def adjusted_row(
    params: SamplingParams, num_output: int = 0, output: list[int] | None = None
) -> torch.Tensor:
    history = ([4], [0] * num_output if output is None else output)
    rows, sample_rows = _adjusted(LOGITS, [params], [0], [history], [EOS])
    return rows[sample_rows[0]]


def masked(row: torch.Tensor) -> list[int]:
    return torch.isinf(row).nonzero().flatten().tolist()


def test_allowed_token_ids_mask_every_other_token() -> None:
    row = adjusted_row(SamplingParams(temperature=0.0, allowed_token_ids=(2, 4, 99)))
    assert masked(row) == [0, 1, 3, 5]
    assert row[2] == 1.0 and row[4] == -1.0  # the allowed keep their logits
    out = sample(LOGITS, [SamplingParams(temperature=0.0, allowed_token_ids=(2, 4), logprobs=1)], [None])
    assert out[0].token_id == 2
    raw = LOGITS[0].log_softmax(-1)
    assert out[0].logprob == pytest.approx(float(raw[2]))  # the raw distribution's
    [(alternative, logprob)] = out[0].top_logprobs or []
    assert alternative == 1 and logprob == pytest.approx(float(raw[1]))


def test_min_tokens_masks_eos_and_stop_ids_until_the_nth_token() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), logprobs=0)
    for num_output in range(3):
        assert masked(adjusted_row(params, num_output)) == [EOS, 3]
        out = sample(LOGITS, [params], [None], [([4], [0] * num_output)], eos_token_ids=[EOS])
        assert out[0].token_id == 2
        assert out[0].logprob == pytest.approx(float(LOGITS[0].log_softmax(-1)[2]))
    assert masked(adjusted_row(params, 3)) == []  # lifted at exactly the 3rd generated token
    out = sample(LOGITS, [params], [None], [([4], [0, 0, 0])], eos_token_ids=[EOS])
    assert out[0].token_id == EOS
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert masked(adjusted_row(ignoring)) == [3]  # EOS ends nothing then: not masked


def test_masks_come_before_penalties_and_sampling() -> None:
    params = SamplingParams(temperature=1.0, allowed_token_ids=(0, 5), repetition_penalty=2.0, seed=1)
    row = adjusted_row(params)
    assert masked(row) == [1, 2, 3, 4]
    gen = torch.Generator()
    gen.manual_seed(1)
    draws = {sample(LOGITS, [params], [gen], [([0], [])], eos_token_ids=[EOS])[0].token_id for _ in range(50)}
    assert draws <= {0, 5}


def test_bad_words_mask_single_tokens_always_and_last_tokens_after_their_prefix() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=((3,), (0, 2, 5), (4, 1)), logprobs=0)
    assert masked(adjusted_row(params, output=[])) == [3]
    assert masked(adjusted_row(params, output=[0])) == [3]  # [0, 2] not yet: only half the prefix
    assert masked(adjusted_row(params, output=[1, 0, 2])) == [3, 5]
    assert masked(adjusted_row(params, output=[0, 2, 4])) == [1, 3]
    assert masked(adjusted_row(params, output=[2, 0])) == [3]
    out = sample(LOGITS, [params], [None], [([4], [0, 4])], eos_token_ids=[EOS])
    assert out[0].token_id == 2  # 1 (the argmax) would end [4, 1]; 3 is banned: next best 2
    assert out[0].logprob == pytest.approx(float(LOGITS[0].log_softmax(-1)[2]))


def test_a_mask_that_would_leave_nothing_is_skipped() -> None:
    params = SamplingParams(temperature=1.0, allowed_token_ids=(EOS,), min_tokens=2)
    row = adjusted_row(params)
    assert masked(row) == [0, 2, 3, 4, 5]  # EOS stays: it is the only token left
    assert not math.isnan(float(row[EOS]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": ["1"]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[-1]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [3]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1, 2]] * 2049}, "bad_words_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidField) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(str(path), max_model_len=64, block_size=4, kv_cache_memory=2**20, max_num_seqs=8)


def assert_idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_engine_generates_only_allowed_ids(llm: LLM) -> None:
    allowed = (11, 23, 42)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    sampled = SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed
    )
    outs = llm.generate([[5, 6, 7], [8, 9]], [params, sampled], use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 12 and set(ids) <= set(allowed), ids
    assert_idle(llm)


def test_engine_min_tokens_then_stops(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids[0]
    forcing = ((eos, 100.0),)  # EOS would be every token's argmax
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5, logit_bias=forcing)
    out = llm.generate([[5, 6, 7]], [params], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stop = SamplingParams(
        max_tokens=20, temperature=0.0, min_tokens=4, stop_token_ids=(9,), logit_bias=((9, 100.0),)
    )
    out = llm.generate([[5, 6, 7]], [stop], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and 9 not in out.token_ids[:4]
    assert_idle(llm)


def test_engine_never_generates_a_bad_word(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7]
    ids = llm.generate([prompt], [plain], use_tqdm=False)[0].outputs[0].token_ids
    single, pair = ids[0], tuple(ids[2:4])  # its first token, and two tokens it generates later
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, bad_words_token_ids=((single,), pair)
    )
    sampled = SamplingParams(
        max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, bad_words_token_ids=((single,), pair)
    )
    for out in llm.generate([prompt, prompt], [params, sampled], use_tqdm=False):
        got = out.outputs[0].token_ids
        assert len(got) == 12 and single not in got, got
        assert all(tuple(got[i : i + 2]) != pair for i in range(len(got) - 1)), got
    assert_idle(llm)
