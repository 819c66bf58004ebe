"""The offline API on a tiny model: validation, sampling controls, stop conditions, no leaks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.dataplane import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(str(path), max_model_len=64, block_size=4, kv_cache_memory=2**20, max_num_seqs=8)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], greedy(4), "prompt"),
        ([5] * 64, greedy(4), "max_model_len"),
        ([5, 999999], greedy(4), "prompt token ids"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(
    llm: LLM, prompt: list[int], params: SamplingParams, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params, use_tqdm=False)
    assert_idle(llm)


def test_text_prompt_without_tokenizer_is_a_clear_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", greedy(2), use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_engine_keeps_serving_after_a_refusal(llm: LLM) -> None:
    engine = llm.engine
    good = engine.add_request([7, 8, 9], greedy(6))
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([3] * 80, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    assert good.num_output_tokens == 6 and good.finish_reason == "length"
    alone = llm.generate([[7, 8, 9]], greedy(6), use_tqdm=False)[0]
    assert alone.token_ids == good.output_token_ids
    assert_idle(llm)


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[4, 5], []], greedy(3), use_tqdm=False)
    assert_idle(llm)


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    base = llm.generate([[10, 11, 12]], greedy(12), use_tqdm=False)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop = base.token_ids[5]
    first = base.token_ids.index(stop)
    out = llm.generate(
        [[10, 11, 12]],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: first + 1]
    assert_idle(llm)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    base = llm.generate([[20, 21]], greedy(10), use_tqdm=False)[0]
    eos = llm.engine.eos_token_ids[0]
    # Make the engine treat a token it will produce as EOS by asking for it as a stop: EOS itself
    # is exercised in the scheduler tests; here we check ignore_eos keeps going past a real EOS id.
    assert eos == 2
    kept = llm.generate(
        [[20, 21]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert kept[0].token_ids == base.token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([[30, 31, 32]], params, use_tqdm=False)[0].token_ids
    crowd = llm.generate(
        [[40, 41], [30, 31, 32], [50] * 20],
        [greedy(7), params, SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True)],
        use_tqdm=False,
    )
    assert crowd[1].token_ids == alone
    other_seed = llm.generate(
        [[30, 31, 32]], SamplingParams(max_tokens=10, seed=99, ignore_eos=True), use_tqdm=False
    )
    assert other_seed[0].token_ids != alone
    assert_idle(llm)


def test_top_k_one_is_greedy(llm: LLM) -> None:
    g = llm.generate([[60, 61, 62]], greedy(8), use_tqdm=False)[0].token_ids
    k1 = llm.generate([[60, 61, 62]], SamplingParams(max_tokens=8, top_k=1, ignore_eos=True), use_tqdm=False)
    assert k1[0].token_ids == g


def test_outputs_come_back_in_prompt_order_with_counts(llm: LLM) -> None:
    prompts = [[5] * n for n in (9, 1, 30, 4)]
    lengths = [3, 7, 1, 5]
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.num_prompt_tokens for o in outs] == [9, 1, 30, 4]
    assert [o.num_output_tokens for o in outs] == lengths
    assert all(o.latency > 0 for o in outs)


def test_our_kernels_package_is_not_mistaken_for_the_pypi_one(tmp_path: Path) -> None:
    """transformers probes for a `kernels` distribution (hub kernels); ours must not trigger it."""
    model_dir = make_tiny_model("llama", tmp_path / "m")
    script = f"""
import importlib.util, sys
import pagedserve.kernels as kernels
assert kernels.__file__.startswith({str(REPO)!r}), kernels.__file__
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available(), "transformers thinks our kernels package is the hub one"
import transformers.integrations.hub_kernels as hub
assert not hasattr(hub, "get_kernel_hub"), "transformers imported hub-kernel symbols"
from pagedserve.dataplane import LLM, SamplingParams
llm = LLM({str(model_dir)!r}, max_model_len=32, kv_cache_memory=2**20)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
assert len(out[0].token_ids) == 3
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.fixture(scope="module")
def served_llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Path]:
    """The tiny model with a byte-level BPE tokenizer: a token can hold part of a character."""
    from tests.e2e.hardening.tiny_served import make_tiny_served_model

    path = make_tiny_served_model(tmp_path_factory.mktemp("served") / "llama")
    return LLM(str(path), max_model_len=64, block_size=4, kv_cache_memory=2**20, max_num_seqs=8), path


def test_offline_text_withholds_an_incomplete_trailing_character_as_a_stream_does(
    served_llm: tuple[LLM, Path],
) -> None:
    """Issue 12: offline `LLM.generate` text ended in U+FFFD where generation stopped inside a
    UTF-8 character, while a stream of the same tokens withholds that partial character. Both
    now give the same text: the offline one drops the incomplete trailing character too (its
    token stays in `token_ids`)."""
    from pagedserve.controlplane.detokenizer import IncrementalDetokenizer
    from pagedserve.controlplane.tokenizer import Tokenizer

    llm, path = served_llm
    tokenizer = Tokenizer(path)
    complete = tokenizer.encode(" the")[0]  # a whole word
    partial = tokenizer.encode("€")[0]  # 0xE2, the first of the euro sign's 3 bytes
    assert tokenizer.decode([partial]) == "\ufffd"
    prompt = tokenizer.encode("Hello world")
    cases: list[list[int]] = []
    for seed in range(16):  # seeded draws between the two tokens, both biased far above the rest
        params = SamplingParams(
            max_tokens=4,
            temperature=1.0,
            seed=seed,
            ignore_eos=True,
            logit_bias=((complete, 100.0), (partial, 100.0)),
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        stream = IncrementalDetokenizer(tokenizer, prompt)
        streamed = "".join(stream.add([t]) for t in out.token_ids) + stream.flush()  # one token a delta
        assert out.text == streamed, (out.token_ids, out.text, streamed)
        assert not out.text.endswith("\ufffd")
        cases.append(out.token_ids)
    # The cases that matter happened: whole text, then a partial character at the very end.
    ending_inside = [ids for ids in cases if ids[-1] == partial and complete in ids]
    assert ending_inside and all(tokenizer.decode(ids).endswith("\ufffd") for ids in ending_inside)
    assert_idle(llm)
