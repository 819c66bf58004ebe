"""LLMEngine: owns the block pool, the scheduler and the model runner, and steps them."""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagedserve.common.log import StartupPhases, get_logger
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import EngineConfig
from pagedserve.dataplane.engine.outputs import EngineStats, StepResult, sample_request_id
from pagedserve.dataplane.engine.sample_groups import Riders, SampleGroups
from pagedserve.dataplane.engine.speculator import Speculator
from pagedserve.dataplane.engine.startup import load_engine_model, plan_kv, start_runner
from pagedserve.dataplane.kvcache import BlockHash, BlockPool, KVCacheManager, KVEventRecord
from pagedserve.dataplane.runner.quant_linear import weight_bytes
from pagedserve.dataplane.runner.sampler import SampledToken
from pagedserve.dataplane.scheduler import Request, Scheduler, SchedulerOutput
from pagedserve.dataplane.scheduler.step_budget import split_tokens

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from pagedserve.dataplane.structured.compile_service import CompileService

log = get_logger(__name__)
MAX_ISOLATED_REQUESTS = 256
"""The most requests a faulted step is rerun one by one for (a batch is at most max_num_seqs)."""


def _appended_tokens(
    out: SchedulerOutput, sampled: dict[str, SampledToken], before: dict[str, int]
) -> dict[str, list[int]]:
    """The tokens each request took this step (a drafted run: its accepted drafts, then its
    own token, up to a stop within it), their logprobs recorded; the riders' first tokens."""
    taken: dict[str, list[int]] = {}
    for item in out.scheduled:
        request = item.request
        token = sampled.get(request.request_id)
        if token is None:
            continue
        run = [*token.accepted, token][: request.num_output_tokens - before[request.request_id]]
        for t in run:
            if t.logprob is not None:
                request.output_logprobs.append(t.logprob)
                if t.top_logprobs is not None:
                    request.output_top_logprobs.append(t.top_logprobs)
        if run:
            taken[request.request_id] = [t.token_id for t in run]
    scheduled = set(before)
    taken.update((rid, [t.token_id]) for rid, t in sampled.items() if rid not in scheduled)
    return taken


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.startup = StartupPhases(log)
        loaded = load_engine_model(config, self.startup)
        self.model_path, self.tokenizer = loaded.path, loaded.tokenizer
        self.max_model_len, self.eos_token_ids = loaded.max_model_len, loaded.eos_token_ids
        plan = plan_kv(config, loaded)
        self.budget, self.kv_scales = plan.budget, plan.kv_scales
        self.pool = BlockPool(plan.budget.num_blocks, enable_kv_events=config.cache.enable_kv_events)
        self.host_pool = BlockPool(plan.num_host_blocks) if plan.num_host_blocks else None
        self.startup.done("kv_plan", blocks=plan.budget.num_blocks, host_blocks=plan.num_host_blocks)
        self.kv_cache = KVCacheManager(
            self.pool,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_seed=config.cache.prefix_hash_seed,
            host_pool=self.host_pool,
        )
        self.scheduler = Scheduler(self.kv_cache, config.scheduler, self.max_model_len)
        self.swap_seconds = 0.0
        self._whole_step_faults = 0  # steps in a row whose one request faulted (see _isolate_fault)
        self.runner, self.parallel = start_runner(config, loaded.model, plan)
        if self.parallel is not None:
            weakref.finalize(self, self.parallel.shutdown)
        # The runner builds (once per machine) or loads the C++ kernels and times the linears.
        # The weights as they sit in memory once packed (quantized ones: values, scales, mins).
        self.startup.done("kernels", weight_bytes=weight_bytes(self.runner.model))
        self._ids = itertools.count()
        self.groups = SampleGroups(self.runner, self.scheduler, loaded.model.config.vocab_size)
        spec = config.scheduler.speculative
        self.speculator = Speculator(spec) if spec is not None else None
        self._grammars: CompileService | None = None

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer; pass prompts as token-id lists")
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False)
            return ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """Validate, tokenize and queue one request; raises ValueError naming the bad field.

        With `pooling` it is an embedding request (one sample, prompt-only): it ends once its
        prompt is computed, its vector in `Request.embedding` (dataplane/runner/pooling.py).

        `priority` (lower runs first), `tenant` and its `tenant_weight` (its share of the batch
        among the tenants present) apply to every sample of the request.

        A request with a `params.constraint` needs its compiled `grammar`: the server compiles
        it off the step loop first (`grammars().submit`); without one it is compiled here,
        blocking (the offline API), and a constraint that cannot be compiled raises GrammarError
        (a ValueError). Every sample gets its own matcher.

        With `params.n` / `best_of` > 1 the returned request is the first sample; the others
        (ids from `sample_request_id`) join once it has computed the prompt, sharing its full
        prompt blocks through the prefix cache. `samples_of(id)` lists all of them until
        `release(id)`, which a caller must do once it has read a finished request's outputs.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        if params.constraint is not None and grammar is None:
            grammar = self.grammars().compile(params.constraint)
        if params.constraint is None:
            grammar = None
        tags = {"priority": priority, "tenant": tenant, "tenant_weight": tenant_weight}
        samples = []
        for i in range(params.num_samples):
            sample = replace(params, seed=params.seed + i) if i and params.seed is not None else params
            if i:  # the first sample scores the prompt; the others may share its cached blocks
                sample = replace(sample, prompt_logprobs=None)
            rid_i = sample_request_id(rid, i) if i else rid
            samples.append(self._new_request(rid_i, token_ids, sample, cache_salt, grammar, **tags))
        if pooling is not None:
            if len(samples) > 1 or grammar is not None:
                raise ValueError("a pooling request has one sample and no constraint")
            samples[0].pooling = pooling
        self.groups.add(samples)
        return samples[0]

    def _new_request(
        self,
        rid: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: CompiledGrammar | None,
        **tags: Any,
    ) -> Request:
        """One sample's request; `tags`: its priority, tenant and tenant weight."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            # Models with several end tokens (chat end + document end) stop on any of them.
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(rid, token_ids, params, eos_token_id=eos, cache_salt=cache_salt, **tags)
        if grammar is not None:
            from pagedserve.dataplane.structured.grammar import (
                GrammarState,  # imports xgrammar: only when used
            )

            request.grammar = GrammarState(grammar)
        return request

    def grammars(self) -> CompileService:
        """The structured-output compiler, started on first use (it needs the tokenizer)."""
        if self._grammars is None:
            from pagedserve.dataplane.structured.compile_service import CompileService

            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and {self.model_path} has none")
            self._grammars = CompileService(
                self.tokenizer,
                str(self.model_path),
                self.runner.model.config.vocab_size,
                self.eos_token_ids,
                timeout_s=self.config.scheduler.structured_outputs_compile_timeout,
            )
        return self._grammars

    def close(self) -> None:
        """Stop the engine's helpers (the grammar compiler process, the mask thread); idempotent."""
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None
        self.runner.close()

    def samples_of(self, request_id: str) -> list[Request]:
        """Every sample of a request added with `add_request` (one unless n/best_of > 1)."""
        return self.groups.samples_of(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request group once its outputs have been read (the engine keeps them until then)."""
        self.groups.release(request_id)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a request and all its samples, freeing their blocks; returns the primary
        request, or None when the id is unknown (or already released)."""
        return self.groups.abort(request_id)

    def abort_sample(self, request_id: str, index: int) -> Request | None:
        """Abort sample `index` of request `request_id` (e.g. it matched a stop string the
        control plane watches) and free its blocks: shared prefix blocks lose one reference,
        the others' ref counts are untouched and its siblings run on. The group stays listed
        by `samples_of` until `release`. Returns the sample, or None when the id is unknown,
        the index out of range or the sample already finished."""
        return self.groups.abort_sample(request_id, index)

    def step(self) -> StepResult:
        """Schedule, run the model once on the flattened batch (after the step's swap copies),
        take the sampled tokens and retire finished requests."""
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.room)
        out = self.scheduler.schedule()
        riders, draws = self.groups.plan(out)
        sampled, faulted = self._execute(out, riders)
        return self._update(out, sampled, riders, draws, faulted, started)

    def _execute(
        self, out: SchedulerOutput, riders: Riders
    ) -> tuple[dict[str, SampledToken], dict[str, str]]:
        """The step's swap copies (out, then in: before the forward, which may rewrite blocks
        swapped out and reads those swapped in), then its forward and samples. A forward that
        raises is rerun request by request (`_isolate_fault`); riders are then left out (each
        request's rerun draws its own token only)."""
        if out.swap_out or out.swap_in:
            start = time.perf_counter()
            self.runner.swap(out.swap_out, out.swap_in)
            self.swap_seconds += time.perf_counter() - start
        if out.is_empty:
            return {}, {}
        try:
            sampled = self.runner.execute(out, riders)
            self._whole_step_faults = 0
            return sampled, {}
        except Exception as exc:
            riders.clear()
            return self._isolate_fault(out, exc)

    def _update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, SampledToken],
        riders: Riders,
        draws: int,
        faulted: dict[str, str],
        started: float,
    ) -> StepResult:
        """Append each scheduled request's token (and logprobs), let the samples' groups take
        their first tokens, retire what finished."""
        mixed = self.scheduler.mixed_step_budget  # (None: --prefill-stretch off, nothing timed)
        timed = (mixed is not None or self.speculator is not None) and not out.is_empty
        tokens = split_tokens(out) if timed else None  # before the output moves them on
        accepted = {rid: [a.token_id for a in t.accepted] for rid, t in sampled.items() if t.accepted}
        before = {item.request.request_id: item.request.num_output_tokens for item in out.scheduled}
        finished = (
            self.scheduler.update_from_output(out, {r: t.token_id for r, t in sampled.items()}, accepted)
            if not out.is_empty
            else []
        )
        token_ids = _appended_tokens(out, sampled, before)
        drawn, done = self.groups.collect(riders, sampled, draws)
        token_ids.update((rid, [t.token_id]) for rid, t in drawn.items())
        finished.extend(done)
        self.runner.fill_masks_ahead(out.scheduled)
        self._retire(finished)
        if tokens is not None:
            elapsed = time.perf_counter() - started
            if mixed is not None:
                mixed.observe(*tokens, elapsed)
            if self.speculator is not None:
                self.speculator.verified(out, accepted, elapsed if tokens[0] == 0 else None)
        return StepResult(token_ids, finished, out.num_batched_tokens, len(out.preempted), faulted)

    def _retire(self, finished: list[Request]) -> None:
        now = time.monotonic()
        for request in finished:
            request.finish_time = now
            self.runner.release(request.request_id)
        if self.speculator is not None:
            self.speculator.finished(finished)
        if finished and not self.has_unfinished_requests():
            # Idle is the one moment every block must be free: verify it (O(num_blocks)).
            self.check_integrity()
            assert self.pool.num_free_blocks == self.pool.num_blocks, "KV blocks leaked"
            if self.host_pool is not None:
                assert self.host_pool.num_free_blocks == self.host_pool.num_blocks, "host blocks leaked"

    def _isolate_fault(
        self, out: SchedulerOutput, exc: Exception
    ) -> tuple[dict[str, SampledToken], dict[str, str]]:
        """A step raised: find the requests it came from by running each alone (the step had
        changed nothing yet but the KV its forward wrote, which a rerun writes again, the
        same), abort those, keep the others' tokens. A fault every request meets alone is
        not any request's (a kernel fault, a broken invariant): it is raised, and ends the
        loop. With one request in the step that cannot be told apart; it is blamed once, and
        a second such step in a row is raised."""
        if self.runner.step_listener is not None or len(out.scheduled) > MAX_ISOLATED_REQUESTS:
            raise exc  # tensor-parallel workers replay every forward: no rerun is safe
        log.warning("step_fault_isolating", requests=len(out.scheduled), error=repr(exc)[:500])
        sampled: dict[str, SampledToken] = {}
        faulted: dict[str, str] = {}
        for item in out.scheduled:
            try:
                sampled.update(self.runner.execute(SchedulerOutput(scheduled=[item])))
            except Exception as own:
                faulted[item.request.request_id] = repr(own)[:500]
        if len(faulted) == len(out.scheduled) and (len(faulted) > 1 or self._whole_step_faults > 0):
            raise exc
        self._whole_step_faults = 1 if len(faulted) == len(out.scheduled) else 0
        for engine_id, error in faulted.items():
            log.error("request_faulted", request_id=engine_id, error=error)
            self.abort_request(self.groups.primary_of(engine_id))
        return sampled, faulted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.groups.has_pending()

    # -- reports -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            token_usage=self.kv_cache.token_usage,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache=replace(self.kv_cache.prefix_cache_stats),
            num_swapped=self.scheduler.num_swapped,
            num_preemptions_swap=self.scheduler.num_swap_preemptions,
            num_preemptions_recompute=self.scheduler.num_recompute_preemptions,
            blocks_swapped_out=self.scheduler.num_blocks_swapped_out,
            blocks_swapped_in=self.scheduler.num_blocks_swapped_in,
            swap_seconds=self.swap_seconds,
            host_total_blocks=0 if self.host_pool is None else self.host_pool.num_blocks,
            host_free_blocks=0 if self.host_pool is None else self.host_pool.num_free_blocks,
            **self._speculation_stats(),
        )

    def _speculation_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        spec = self.speculator.stats
        return {
            "spec_drafts": spec.runs,
            "spec_draft_tokens": spec.drafted_tokens,
            "spec_accepted_tokens": spec.accepted_tokens,
        }

    def take_kv_events(self) -> list[KVEventRecord]:
        """The KV events since the last call (none unless the cache config enables them)."""
        return self.kv_cache.take_events()

    def cached_block_hashes(self) -> set[BlockHash]:
        """Every block hash the prefix cache holds: what replaying the KV events reproduces."""
        return self.pool.cached_block_hashes()

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
