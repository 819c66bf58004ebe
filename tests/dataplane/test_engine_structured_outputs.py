"""Structured outputs in the engine, on the real default model: every completion matches its
constraint, unconstrained neighbours are untouched, and preemption, prefix hits and n > 1
leave each sample's matcher in step with its tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pagedserve.common.constraints import Constraint
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.structured.grammar import GrammarError

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}
PROMPTS = [
    "Describe a person called Ada as JSON.",
    "Give me a JSON record of a retired teacher.",
    "JSON for a child who owns a dog:",
    "Make up a person. Answer in JSON.",
]


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Any:
    engine = LLM(str(default_model_path), max_model_len=512, kv_cache_memory=64 * 2**20, num_threads=2)
    yield engine
    engine.engine.close()


def chat(llm: Any, text: str) -> str:
    prompt: str = llm.apply_chat_template([{"role": "user", "content": text}])
    return prompt


def schema_params(**kw: Any) -> SamplingParams:
    settings: dict[str, Any] = {"max_tokens": 80, "temperature": 0.0, **kw}
    return SamplingParams(constraint=Constraint("json_schema", json.dumps(PERSON)), **settings)


def test_json_schema_outputs_validate_and_stop(llm: Any) -> None:
    outs = llm.generate([chat(llm, p) for p in PROMPTS], schema_params(), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        # Properties come in the schema's order (the normalised schema keeps it).
        assert list(json.loads(out.text)) == ["name", "age", "pets"]


def test_choice_regex_and_json_object(llm: Any) -> None:
    choice = SamplingParams(
        max_tokens=8, temperature=0.0, constraint=Constraint("choice", choices=("yes", "no", "maybe"))
    )
    regex = SamplingParams(
        max_tokens=16, temperature=0.0, constraint=Constraint("regex", r"[0-9]{3}-[0-9]{4}")
    )
    obj = SamplingParams(max_tokens=120, temperature=0.0, constraint=Constraint("json_object"))
    grammar = SamplingParams(
        max_tokens=16, temperature=0.0, constraint=Constraint("grammar", 'root ::= "x=" [0-9] [0-9]? ";"')
    )
    outs = llm.generate(
        [
            chat(llm, "Is water wet?"),
            chat(llm, "A phone number:"),
            chat(llm, 'Reply with the JSON object {"city": "Paris", "country": "France"} and nothing else.'),
            "x",
        ],
        [choice, regex, obj, grammar],
        use_tqdm=False,
    )
    assert outs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[1].text), outs[1].text
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(r"x=[0-9][0-9]?;", outs[3].text), outs[3].text
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_each_sample_has_its_own_matcher(llm: Any) -> None:
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=7, n=4, constraint=Constraint("regex", r"(ab|cd){2,4}!")
    )
    (out,) = llm.generate([chat(llm, "Letters:")], params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4
    for text in texts:
        assert re.fullmatch(r"(ab|cd){2,4}!", text), texts


def test_unconstrained_neighbours_get_the_same_tokens(llm: Any) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [chat(llm, "What is the capital of France?"), chat(llm, "Name three colours.")]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(
        [prompts[0], chat(llm, PROMPTS[0]), prompts[1], chat(llm, PROMPTS[1])],
        [plain, schema_params(), plain, schema_params()],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].text), PERSON)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_greedy_equals_the_unpreempted_run(
    llm: Any, default_model_path: Path, mode: str
) -> None:
    prompts = [chat(llm, f"{p} (record {i})") for i, p in enumerate(PROMPTS * 2)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, schema_params(), use_tqdm=False)]
    small = LLM(
        str(default_model_path),
        max_model_len=512,
        num_gpu_blocks_override=24,
        block_size=16,
        max_num_seqs=8,
        preemption_mode=mode,
        num_threads=2,
    )
    try:
        outs = small.generate(prompts, schema_params(), use_tqdm=False)
        stats = small.engine.stats()
    finally:
        small.engine.close()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert small.engine.pool.num_free_blocks == small.engine.pool.num_blocks


def test_prefix_cache_hits_keep_the_output(llm: Any) -> None:
    prompt = chat(llm, PROMPTS[2])
    first = llm.generate([prompt], schema_params(), use_tqdm=False)[0]
    second = llm.generate([prompt], schema_params(), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_max_tokens_mid_object_finishes_with_length(llm: Any) -> None:
    out = llm.generate([chat(llm, PROMPTS[0])], schema_params(max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5
    assert out.text.startswith("{")


def test_uncompilable_constraints_are_refused_by_kind_and_the_engine_goes_on(llm: Any) -> None:
    for constraint in (
        Constraint("json_schema", json.dumps({"$ref": "#/$defs/missing"})),
        Constraint("regex", "(unclosed"),
        Constraint("grammar", "root ::= undefined_rule"),
    ):
        with pytest.raises(GrammarError, match=f"^{constraint.kind} could not be compiled"):
            llm.generate(["x"], SamplingParams(max_tokens=4, constraint=constraint), use_tqdm=False)
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    (out,) = llm.generate([chat(llm, PROMPTS[3])], schema_params(), use_tqdm=False)
    jsonschema.validate(json.loads(out.text), PERSON)


def test_equal_constraints_compile_once(llm: Any) -> None:
    service = llm.engine.grammars()
    before = service.stats
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    for text in (json.dumps(schema), json.dumps(schema, indent=2)):  # the same schema, spelled twice
        llm.generate(
            ["x"], SamplingParams(max_tokens=8, constraint=Constraint("json_schema", text)), use_tqdm=False
        )
    after = service.stats
    assert after.compiles - before.compiles == 1
    assert after.cache_hits - before.cache_hits == 1


def test_a_compile_past_the_timeout_is_refused_and_the_next_compile_works(
    llm: Any, default_model_path: Path
) -> None:
    from pagedserve.dataplane.structured.compile_service import CompileService

    engine = llm.engine
    service = CompileService(
        engine.tokenizer,
        str(default_model_path),
        engine.runner.model.config.vocab_size,
        engine.eos_token_ids,
        timeout_s=5.0,
    )
    try:
        service.compile(Constraint("regex", "warm-up"))  # the child starts (and is timed) here
        service.timeout_s = 1e-4  # no schema compiles against a 49k-token vocabulary this fast
        with pytest.raises(
            GrammarError, match=r"^json_schema could not be compiled within the compile timeout"
        ):
            service.compile(Constraint("json_schema", json.dumps(PERSON)))
        assert service.stats.timeouts == 1
        service.timeout_s = 30.0
        compiled = service.compile(Constraint("json_schema", json.dumps(PERSON)))  # a fresh child
        assert compiled is not None
    finally:
        service.close()


def test_keywords_the_backend_cannot_enforce_are_refused_by_path(llm: Any) -> None:
    for schema, where in (
        ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "#/properties/x/not"),
        ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "#/allOf"),
    ):
        params = SamplingParams(max_tokens=4, constraint=Constraint("json_schema", json.dumps(schema)))
        with pytest.raises(GrammarError, match=f"cannot be enforced while generating: {where}$"):
            llm.generate(["x"], params, use_tqdm=False)


def test_a_refusal_carries_the_backends_message_without_its_log_prefix(llm: Any) -> None:
    params = SamplingParams(
        max_tokens=4, constraint=Constraint("json_schema", json.dumps({"$ref": "#/$defs/nope"}))
    )
    with pytest.raises(GrammarError) as err:
        llm.generate(["x"], params, use_tqdm=False)
    assert not re.search(r"\.cc:[0-9]+", str(err.value)), str(err.value)
    assert "$defs" in str(err.value)


def test_masks_filled_ahead_equal_masks_filled_in_place(llm: Any) -> None:
    """The bitmask rows a worker thread fills while the forward runs are the matcher's own:
    applying them gives the same logits as xgrammar filling and applying row by row, and
    rows without a grammar are untouched (also when the bitmask grows for a later row)."""
    import torch
    import xgrammar as xgr

    from pagedserve.dataplane.structured.grammar import GrammarState, TokenMasks

    compiled = llm.engine.grammars().compile(Constraint("json_schema", json.dumps(PERSON)))
    vocab = llm.engine.runner.model.config.vocab_size
    states = [GrammarState(compiled) for _ in range(3)]
    prefix = llm.tokenizer.encode('{"name": "Al', add_special_tokens=False)
    for token in prefix:
        assert states[1].accept(token)
    masks = TokenMasks(vocab)
    logits = torch.randn(6, vocab)
    expected = logits.clone()
    rows = [(0, states[0]), (2, states[1]), (5, states[2])]
    masks.apply(logits, rows, masks.start_fill(rows))
    for i, state in rows:
        own = xgr.allocate_token_bitmask(1, vocab)
        state.fill_mask(own, 0)
        xgr.apply_token_bitmask_inplace(expected[i : i + 1], own, vocab_size=vocab)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[2]).sum() < torch.isinf(logits[0]).sum()  # inside a string: more allowed
    masks.close()


def test_a_mask_filled_ahead_is_used_only_while_no_token_was_accepted_since(llm: Any) -> None:
    """TokenMasks.fill_ahead fills a state's next mask into its own row after its tokens were
    accepted; the step's start_fill copies that row while it is current, and fills afresh
    once another token was accepted (a stale row would allow the wrong tokens)."""
    import torch
    import xgrammar as xgr

    from pagedserve.dataplane.structured.grammar import GrammarState, TokenMasks

    compiled = llm.engine.grammars().compile(Constraint("json_schema", json.dumps(PERSON)))
    vocab = llm.engine.runner.model.config.vocab_size
    state, fresh = GrammarState(compiled), GrammarState(compiled)
    masks = TokenMasks(vocab)

    def step_mask(row: int) -> torch.Tensor:
        logits = torch.zeros(row + 1, vocab)
        masks.apply(logits, [(row, state)], masks.start_fill([(row, state)]))
        return torch.isinf(logits[row])

    def own_mask() -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        own = xgr.allocate_token_bitmask(1, vocab)
        state.fill_mask(own, 0)
        xgr.apply_token_bitmask_inplace(logits, own, vocab_size=vocab)
        return torch.isinf(logits[0])

    masks.fill_ahead([state, fresh])
    assert state.ahead_is_current and fresh.ahead_is_current
    at_start = step_mask(1)
    assert torch.equal(at_start, own_mask())
    assert state.ahead is not None and masks._bitmask[1].equal(state.ahead[0])  # copied, not refilled
    for token in llm.tokenizer.encode('{"name": "Al', add_special_tokens=False):
        assert state.accept(token)
    assert not state.ahead_is_current and fresh.ahead_is_current  # accepting made it stale
    inside = step_mask(0)
    assert torch.equal(inside, own_mask()) and not torch.equal(inside, at_start)
    masks.fill_ahead([state])
    assert state.ahead_is_current and torch.equal(step_mask(3), own_mask())
    masks.close()


def test_the_engine_fills_masks_off_the_step_path(llm: Any) -> None:
    runner = llm.engine.runner
    waited, filled = runner.mask_seconds, runner.mask_fill_seconds
    (out,) = llm.generate([chat(llm, PROMPTS[0])], schema_params(), use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert runner.mask_fill_seconds > filled and runner.mask_seconds > waited
