"""The default model (real weights) asked to repeat a passage: the n-gram and suffix drafters'
drafts are accepted, and greedy output is token for token the output without drafting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.dataplane import LLM, SamplingParams

PASSAGE = (
    "The old mill at the edge of the valley was built in the early eighteenth century, when the "
    "river still ran fast enough to turn a wheel through most of the year. Farmers from three "
    "villages brought their grain there after the harvest."
)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_from_the_prompt_are_accepted_and_change_nothing(
    default_model_path: Path, method: str
) -> None:
    config = json.dumps({"method": method, "num_speculative_tokens": 5})
    llm = LLM(str(default_model_path), speculative_config=config, kv_cache_memory=2**28, swap_space=0)
    prompt = llm.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}])
    plain = SamplingParams(max_tokens=48, temperature=0.0, speculative=False)
    drafted = SamplingParams(max_tokens=48, temperature=0.0)
    want = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate([prompt], drafted, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    stats = llm.engine.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted_tokens >= len(want) // 4  # the answer copies the prompt: most drafts hold
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_structured_output_drafts_only_what_the_grammar_allows(default_model_path: Path) -> None:
    from pagedserve.common.constraints import Constraint

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
    }
    record = {"name": "Ada Lovelace", "city": "London", "age": 36}
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 5})
    llm = LLM(str(default_model_path), speculative_config=config, kv_cache_memory=2**28, swap_space=0)
    ask = f"Copy this record as JSON: {json.dumps(record)}"
    prompt = llm.apply_chat_template([{"role": "user", "content": ask}])
    constraint = Constraint("json_schema", json.dumps(schema))
    plain = SamplingParams(max_tokens=64, temperature=0.0, constraint=constraint, speculative=False)
    drafted = SamplingParams(max_tokens=64, temperature=0.0, constraint=constraint)
    want = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    got = llm.generate([prompt], drafted, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.finish_reason == "stop"
    value = json.loads(got.text)
    assert set(value) == {"name", "city", "age"} and isinstance(value["age"], int)
    assert llm.engine.speculator.stats.accepted_tokens > 0  # type: ignore[union-attr]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
