"""Constraints compiled into token-level grammars, and the per-sample matcher state, through
xgrammar (the grammar backend vLLM and SGLang default to).

A compiled grammar is bound to one tokenizer and vocabulary size (the model's logits width,
which may exceed the tokenizer's). A `GrammarState` is one sample's position in its grammar:
it fills that sample's row of the step's token bitmask and advances on each accepted token.
It is created once per sample (n > 1: one each) and lives on the request, so preemption
(recompute or swap) and prefix-cache hits leave it where it is: they recompute KV, not tokens.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from pagedserve.common.constraints import Constraint


class GrammarError(ValueError):
    """A constraint the backend refuses (a bad schema, regex or grammar), or one it could not
    compile in time. The message names the constraint's kind ("json_schema could not be ...")."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind} {reason}")
        self.kind = kind
        self.reason = reason


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The backend's view of a Hugging Face tokenizer: its tokens' bytes, padded to the
    model's `vocab_size`; `stop_token_ids` (the model's EOS ids) end a finished grammar."""
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# "[15:40:02] /project/cpp/json_schema_converter.cc:4950: " before the backend's own message.
_BACKEND_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def unenforced_keyword(schema: object, path: str = "#") -> str | None:
    """Where a schema uses a keyword the backend would silently not enforce (its output could
    then violate the schema and still finish with "stop"): `not`, and `allOf` with more than
    one subschema. None when there is none. `oneOf` is generated as `anyOf` (documented)."""
    stack: list[tuple[object, str]] = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if "not" in node:
                return f"{where}/not"
            all_of = node.get("allOf")
            if isinstance(all_of, list) and len(all_of) > 1:
                return f"{where}/allOf"
            stack.extend((v, f"{where}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node))
    return None


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """Compile one constraint; raises GrammarError naming its kind.

    JSON is generated compactly (no free whitespace between tokens): with free whitespace a
    small model can emit newlines until max_tokens inside a valid prefix. A schema is held
    strictly (no properties or items beyond those it lists), which keeps every output valid
    under the schema as written; `json_object` allows any properties.
    """
    if constraint.kind == "json_schema":
        where = unenforced_keyword(json.loads(constraint.value))
        if where is not None:
            raise GrammarError(
                constraint.kind, f"uses a keyword that cannot be enforced while generating: {where}"
            )
    try:
        if constraint.kind == "json_schema":
            return compiler.compile_json_schema(constraint.value, any_whitespace=False, strict_mode=True)
        if constraint.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.value)
        if constraint.kind == "choice":
            return compiler.compile_grammar(choice_grammar(constraint.choices))
        return compiler.compile_grammar(constraint.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        text = str(exc).strip()
        reason = _BACKEND_LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise GrammarError(constraint.kind, f"could not be compiled: {reason[:500]}") from None


class GrammarState:
    """One sample's matcher: `accept` each generated token, `fill_mask` before each sampling."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.accepted = 0  # tokens accepted so far: what a mask filled ahead was filled for
        self.ahead: torch.Tensor | None = None  # [1, words]: the next mask, filled ahead
        self.ahead_for = -1  # `accepted` when `ahead` was (to be) filled; -1: never

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (the state is then
        unchanged, and the sample must stop)."""
        ok = bool(self._matcher.accept_token(token_id))
        if ok:
            self.accepted += 1
        return ok

    @property
    def ahead_is_current(self) -> bool:
        """A fill ahead was started since the last accepted token (TokenMasks.fill_ahead)."""
        return self.ahead is not None and self.ahead_for == self.accepted

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (one bit per token id)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` (speculative decoding) the grammar allows from here, in order,
        short of one that would end it (the row after that would have no mask; the stop token
        is sampled at its own row instead). On a copy of the matcher, which may be filling a
        mask ahead on the worker thread meanwhile (both only read it)."""
        matcher = self._matcher.fork()
        for n, token in enumerate(drafts):
            if not matcher.accept_token(token) or matcher.is_terminated():
                return n
        return len(drafts)

    def after(self, drafts: Sequence[int]) -> DraftedState:
        """The state that fills the mask of the row after `drafts` (which the grammar allows)."""
        return DraftedState(self, tuple(drafts))


class DraftedState:
    """A sample's grammar position after some drafted tokens, for the mask of a drafted row:
    filled on a copy of the matcher advanced past them, so the sample's own stays where its
    accepted tokens left it."""

    ahead_is_current = False

    def __init__(self, state: GrammarState, drafts: tuple[int, ...]) -> None:
        self.state = state
        self.drafts = drafts

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        matcher = self.state._matcher.fork()
        for token in self.drafts:
            matcher.accept_token(token)
        matcher.fill_next_token_bitmask(bitmask, row)


# What fills a row of the step's bitmask: a sample's state, or its state after drafted tokens.
MaskSource = GrammarState | DraftedState


class TokenMasks:
    """The step's token bitmask, allocated once for the rows it has seen and reused: only the
    constrained rows are filled and applied, so unconstrained rows in the same batch are never
    touched.

    Filling is most of the mask work (a matcher inside a long string walks many tokens) and
    needs only the matchers, which are final once the previous step's tokens were accepted.
    So the engine calls `fill_ahead` right after accepting a step's tokens: the running
    samples' next masks are filled on a worker thread (the backend releases the GIL) while
    the engine retires requests, schedules and builds the next step's inputs, single-threaded
    Python that leaves a core idle. Filling during the forward instead (as `start_fill` does
    for a row without a current fill ahead: a new, resumed or recomputed sample) takes a core
    from the forward's threads, which slows the step down on a machine with few cores.
    `apply` waits for the fills, copies the rows filled ahead into the step's bitmask, then
    masks the logits. Nothing touches a matcher between its fill and the step's sampling: the
    engine accepts tokens after sampling, and fill jobs run one at a time, in order.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._filler: ThreadPoolExecutor | None = None
        self.fill_seconds = 0.0  # time the fills took (on the worker thread, mostly overlapped)

    def _worker(self) -> ThreadPoolExecutor:
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._filler

    def fill_ahead(self, states: Sequence[GrammarState]) -> None:
        """Start filling each state's next mask into its own row (`state.ahead`), on the worker
        thread; the next `start_fill` of a state uses it while it is still current."""
        todo = [state for state in states if not state.terminated]
        if not todo:
            return
        for state in todo:
            if state.ahead is None:
                state.ahead = xgr.allocate_token_bitmask(1, self.vocab_size)
            state.ahead_for = state.accepted
        self._worker().submit(self._fill_ahead, todo)

    def _fill_ahead(self, states: list[GrammarState]) -> None:
        started = time.perf_counter()
        for state in states:
            assert state.ahead is not None
            state.fill_mask(state.ahead, 0)
        self.fill_seconds += time.perf_counter() - started

    def start_fill(self, rows: Sequence[tuple[int, MaskSource]]) -> Future[None]:
        """Fill `rows` (bitmask row i from its state: copied from its fill ahead when that is
        current, else filled now) on the worker thread; `apply` waits."""
        needed = max(i for i, _ in rows) + 1
        if self._bitmask.shape[0] < needed:
            self._bitmask = xgr.allocate_token_bitmask(
                max(needed, 2 * self._bitmask.shape[0]), self.vocab_size
            )
        # Decided here, on the engine's thread: a fill ahead submitted earlier runs before this
        # job (one worker, in order), so its rows are complete when this job copies them.
        copies = [
            (i, state) for i, state in rows if isinstance(state, GrammarState) and state.ahead_is_current
        ]
        fills = [(i, state) for i, state in rows if not state.ahead_is_current]
        return self._worker().submit(self._fill, fills, copies)

    def _fill(self, rows: list[tuple[int, MaskSource]], copies: list[tuple[int, GrammarState]]) -> None:
        started = time.perf_counter()
        for i, state in rows:
            state.fill_mask(self._bitmask, i)
        with torch.inference_mode():  # the bitmask may be an inference tensor (allocated in a step)
            for i, state in copies:
                assert state.ahead is not None
                self._bitmask[i].copy_(state.ahead[0])
        self.fill_seconds += time.perf_counter() - started

    def apply(
        self,
        logits: torch.Tensor,
        rows: Sequence[tuple[int, MaskSource]],
        filled: Future[None] | None = None,
    ) -> None:
        """Mask `logits` [N, vocab] in place: row i keeps only what its state allows. `filled`:
        the `start_fill` of these rows (without it they are filled here)."""
        if not rows:
            return
        if filled is None:
            filled = self.start_fill(rows)
        filled.result()  # re-raises the fill's error
        indices = [i for i, _ in rows]
        bitmask = (
            self._bitmask
            if logits.device.type == "cpu"
            else self._bitmask.to(logits.device, non_blocking=True)
        )
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None
