"""LLMEngine: owns the block pool, the scheduler and the model runner, and steps them."""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pagedserve.common.log import StartupPhases, get_logger
from pagedserve.common.models import resolve_model_path
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import EngineConfig
from pagedserve.dataplane.engine.first_tokens import FirstTokenDraws
from pagedserve.dataplane.engine.outputs import EngineStats, StepResult, sample_request_id
from pagedserve.dataplane.engine.startup import (
    eos_token_ids,
    plan_budget,
    plan_host_blocks,
    plan_kv_scales,
    resolve_max_model_len,
)
from pagedserve.dataplane.kvcache import BlockHash, BlockPool, KVCacheManager, KVEventRecord
from pagedserve.dataplane.kvcache.budget import KVCacheShape
from pagedserve.dataplane.parallel.driver import TensorParallelDriver, WorkerLayout
from pagedserve.dataplane.parallel.group import threads_per_rank
from pagedserve.dataplane.parallel.sharding import check_divisible, shard_model
from pagedserve.dataplane.runner.model_loader import DTYPES, load_model, load_tokenizer, quantized_by
from pagedserve.dataplane.runner.model_runner import ModelRunner
from pagedserve.dataplane.runner.quant_linear import weight_bytes
from pagedserve.dataplane.runner.sampler import SampledToken
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from pagedserve.dataplane.scheduler.step_budget import MixedStepBudget, split_tokens
from pagedserve.kernels import kv_cache_torch_dtype

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from pagedserve.dataplane.structured.compile_service import CompileService

log = get_logger(__name__)
MAX_ISOLATED_REQUESTS = 256
"""The most requests a faulted step is rerun one by one for (a batch is at most max_num_seqs)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = config.parallel.tensor_parallel_size
        if config.model.num_threads or tp > 1:
            torch.set_num_threads(threads_per_rank(config.model.num_threads, tp))
        torch.manual_seed(config.model.seed)
        self.startup = StartupPhases(log)
        self.model_path = resolve_model_path(config.model.model, config.model.model_home)
        quantized = quantized_by(self.model_path, config.model.quantization)
        if tp > 1 and quantized:
            raise ValueError(
                f"tensor_parallel_size {tp}: {quantized} runs on one rank so far (quantized weights "
                "are not split); use tensor_parallel_size 1"
            )
        self.tokenizer = load_tokenizer(self.model_path)
        model = load_model(
            self.model_path,
            config.model.dtype,
            config.model.device,
            config.model.quantization,
            config.model.model_impl,
        )
        self.startup.done(
            "weights",
            model=str(self.model_path),
            dtype=config.model.dtype,
            implementation=model.implementation,
        )
        hf = model.config
        self.max_model_len = resolve_max_model_len(config, hf)
        gen_cfg = getattr(model, "generation_config", None)
        self.eos_token_ids = eos_token_ids(hf, gen_cfg)
        if tp > 1:
            check_divisible(hf, tp)
            if model.implementation != "pagedserve":
                raise ValueError(
                    f"tensor_parallel_size {tp}: the model runs on transformers' modules "
                    f"({type(model.hf).__name__}), which are not split; tensor parallelism needs "
                    "one of the owned architectures (Llama, Mistral, Qwen2, Qwen3) and model_impl auto"
                )
            if torch.device(config.model.device).type != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs on the CPU (gloo) only so far")

        kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, DTYPES[config.model.dtype])
        # Per rank: each of the tp ranks' pools holds 1/tp of the KV heads, and the budget
        # (kv_cache_memory, the blocks, the start-up log) counts one rank's bytes.
        shape = KVCacheShape(
            num_layers=hf.num_hidden_layers,
            num_kv_heads=hf.num_key_value_heads // tp,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            bytes_per_element=kv_dtype.itemsize,
        )
        self.budget = plan_budget(config, shape, model, self.max_model_len)
        # The same budget in 16-bit and fp32 elements: an FP8 pool holds 2x and 4x their blocks.
        blocks_16, blocks_32 = self.budget.blocks_at(2), self.budget.blocks_at(4)
        log.info(
            "kv_cache_planned",
            tensor_parallel_size=tp,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            element_type=str(kv_dtype).removeprefix("torch."),
            blocks=self.budget.num_blocks,
            tokens=self.budget.num_tokens,
            bytes_per_token=shape.bytes_per_token,
            blocks_vs_16bit=round(self.budget.num_blocks / blocks_16, 3) if blocks_16 else None,
            blocks_vs_fp32=round(self.budget.num_blocks / blocks_32, 3) if blocks_32 else None,
            max_model_len=self.max_model_len,
            max_concurrency=round(self.budget.max_concurrency(self.max_model_len), 2),
            summary=self.budget.describe(self.max_model_len),
        )
        self.kv_scales = (
            plan_kv_scales(config, self.tokenizer, model, hf.num_hidden_layers, kv_dtype)
            if config.cache.is_fp8
            else None
        )
        block_size = config.cache.block_size
        self.pool = BlockPool(self.budget.num_blocks, enable_kv_events=config.cache.enable_kv_events)
        num_host_blocks = plan_host_blocks(config, shape, self.budget)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        if self.host_pool is None and config.scheduler.preemption_mode == "swap":
            raise ValueError(
                "preemption_mode='swap' needs a host pool: swap_space (or num_cpu_blocks_override) "
                f"leaves no room for a block of {shape.bytes_per_block(block_size)} bytes"
            )
        log.info(
            "swap_space_planned",
            preemption_mode=config.scheduler.preemption_mode,
            host_blocks=num_host_blocks,
            host_bytes=num_host_blocks * shape.bytes_per_block(block_size),
        )
        self.startup.done("kv_plan", blocks=self.budget.num_blocks, host_blocks=num_host_blocks)
        self.kv_cache = KVCacheManager(
            self.pool,
            block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_seed=config.cache.prefix_hash_seed,
            host_pool=self.host_pool,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_model_len=self.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            preemption_mode=config.scheduler.preemption_mode,
            watermark=config.scheduler.watermark,
            max_prefill_tokens_while_decoding=config.scheduler.max_prefill_tokens_while_decoding,
            mixed_step_budget=(
                MixedStepBudget(config.scheduler.prefill_stretch)
                if config.scheduler.prefill_stretch
                else None
            ),
        )
        self.swap_seconds = 0.0
        self._whole_step_faults = 0  # steps in a row whose one request faulted (see _isolate_fault)
        # Tensor parallelism: the workers start now, mirror this rank's block counts and
        # scales, and run every forward with it; this rank alone schedules and samples.
        self.parallel = TensorParallelDriver(config) if tp > 1 else None
        if self.parallel is not None:
            weakref.finalize(self, self.parallel.shutdown)
        try:
            if self.parallel is not None:
                layout = WorkerLayout.of(self.budget.num_blocks, num_host_blocks, self.kv_scales)
                shard_model(model, self.parallel.connect(layout))
            self.runner = ModelRunner(
                model,
                self.budget.num_blocks,
                block_size,
                kv_dtype,
                config.model.device,
                seed=config.model.seed,
                attention_backend=config.model.attention_backend,
                cpu_linear=config.model.cpu_linear,
                cpu_weight_dtype=config.model.cpu_weight_dtype,
                quantized_matmul=config.model.quantized_matmul,
                kv_scales=self.kv_scales,
                num_host_blocks=num_host_blocks,
                tensor_parallel_size=tp,
                step_listener=None if self.parallel is None else self.parallel.send,
            )
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown()
            raise
        # The runner builds (once per machine) or loads the C++ kernels and times the linears.
        # The weights as they sit in memory once packed (quantized ones: values, scales, mins).
        self.startup.done("kernels", weight_bytes=weight_bytes(self.runner.model))
        self._ids = itertools.count()
        # Parallel sampling: siblings of a primary request wait here until the primary has
        # computed the prompt, then join and reuse its cached full blocks (ref counts rise).
        self._pending_siblings: dict[str, list[Request]] = {}
        self._first_tokens = FirstTokenDraws(
            self.runner, self.scheduler, self._pending_siblings, model.config.vocab_size
        )
        self._samples: dict[str, list[Request]] = {}
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
    ) -> Request:
        """Validate, tokenize and queue one request; raises ValueError naming the bad field.

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
        if rid in self._samples:
            raise ValueError(f"request_id {rid!r} is already in use")
        if params.constraint is not None and grammar is None:
            grammar = self.grammars().compile(params.constraint)
        if params.constraint is None:
            grammar = None
        primary = self._new_request(rid, token_ids, params, cache_salt, grammar)
        self.scheduler.add_request(primary)
        samples = [primary]
        for i in range(1, params.num_samples):
            seed = None if params.seed is None else params.seed + i
            sibling = sample_request_id(rid, i)
            samples.append(
                self._new_request(sibling, token_ids, replace(params, seed=seed), cache_salt, grammar)
            )
        if len(samples) > 1:
            self._pending_siblings[rid] = samples[1:]
        self._samples[rid] = samples
        return primary

    def _new_request(
        self,
        rid: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            # Models with several end tokens (chat end + document end) stop on any of them.
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(rid, token_ids, params, eos_token_id=eos, cache_salt=cache_salt)
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
        return list(self._samples.get(request_id, []))

    def release(self, request_id: str) -> None:
        """Forget a request group once its outputs have been read (the engine keeps them until then)."""
        self._samples.pop(request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a request and all its samples, freeing their blocks; returns the primary
        request, or None when the id is unknown (or already released)."""
        samples = self._samples.pop(request_id, None)
        self._pending_siblings.pop(request_id, None)
        self._first_tokens.rows.pop(request_id, None)
        if samples is None:
            return None
        for r in samples:
            if self.scheduler.abort(r.request_id) is None and not r.status.finished:
                r.status = RequestStatus.FINISHED_ABORTED  # a sibling that never joined
            self.runner.release(r.request_id)
        return samples[0]

    def abort_sample(self, request_id: str, index: int) -> Request | None:
        """Abort sample `index` of request `request_id` (e.g. it matched a stop string the
        control plane watches) and free its blocks: shared prefix blocks lose one reference,
        the others' ref counts are untouched and its siblings run on. The group stays listed
        by `samples_of` until `release`. Returns the sample, or None when the id is unknown,
        the index out of range or the sample already finished."""
        samples = self._samples.get(request_id)
        if samples is None or not 0 <= index < len(samples) or samples[index].status.finished:
            return None
        sample = samples[index]
        if self.scheduler.abort(sample.request_id) is None:  # a sibling that never joined
            pending = self._pending_siblings.get(request_id, [])
            self._pending_siblings[request_id] = [s for s in pending if s is not sample]
            sample.status = RequestStatus.FINISHED_ABORTED
        self.runner.release(sample.request_id)
        sample.finish_time = time.monotonic()
        # Siblings wait for the primary's first token, or its end: aborting it must let them
        # join now (a step with nothing scheduled would never admit them).
        self._admit_siblings()
        return sample

    def step(self) -> StepResult:
        """Schedule, make the step's swap copies (out, then in), run the model once on the
        flattened batch, sample, retire finished requests."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if out.swap_out or out.swap_in:
            # Before the forward: swapped-out blocks may be rewritten by it, swapped-in ones read.
            start = time.perf_counter()
            self.runner.swap(out.swap_out, out.swap_in)
            self.swap_seconds += time.perf_counter() - start
        # The step's first-token draws: older requests' samples (kept rows) first, then riders.
        riders, draws = self._first_tokens.plan(out)
        if out.is_empty:
            if not self._first_tokens.rows:
                return StepResult({}, [], 0, len(out.preempted))
            drawn, done = self._first_tokens.draw(draws)  # from the kept rows: no forward
            self._admit_siblings()
            self._retire(done)
            return StepResult({rid: t.token_id for rid, t in drawn.items()}, done, 0, len(out.preempted))
        faulted: dict[str, str] = {}
        mixed = self.scheduler.mixed_step_budget  # (None: --prefill-stretch off, nothing timed)
        tokens = split_tokens(out) if mixed is not None else None  # before the output moves them on
        try:
            sampled = self.runner.execute(out, riders)
            self._whole_step_faults = 0
        except Exception as exc:
            riders = {}  # each request's rerun draws its own token only
            sampled, faulted = self._isolate_fault(out, exc)
        for item in out.scheduled:
            token = sampled.get(item.request.request_id)
            if token is not None and token.logprob is not None:
                item.request.output_logprobs.append(token.logprob)
                if token.top_logprobs is not None:
                    item.request.output_top_logprobs.append(token.top_logprobs)
        token_ids = {rid: t.token_id for rid, t in sampled.items()}
        finished = self.scheduler.update_from_output(out, token_ids)
        if riders:
            finished.extend(self._first_tokens.take(riders, sampled))
            self._first_tokens.keep(riders)
        if self._first_tokens.rows and draws > 0:
            drawn, done = self._first_tokens.draw(draws)
            token_ids.update((rid, t.token_id) for rid, t in drawn.items())
            finished.extend(done)
        self.runner.fill_masks_ahead(out.scheduled)
        self._admit_siblings()
        self._retire(finished)
        if mixed is not None and tokens is not None:
            mixed.observe(*tokens, time.perf_counter() - started)
        return StepResult(token_ids, finished, out.num_batched_tokens, len(out.preempted), faulted)

    def _retire(self, finished: list[Request]) -> None:
        now = time.monotonic()
        for request in finished:
            request.finish_time = now
            self.runner.release(request.request_id)
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
            primary = self._primary_of(engine_id)
            self.abort_request(primary)
        return sampled, faulted

    def _primary_of(self, engine_id: str) -> str:
        """The request id a sample belongs to (samples of n > 1 share their primary's group)."""
        for rid, samples in self._samples.items():
            if any(r.request_id == engine_id for r in samples):
                return rid
        return engine_id

    def _admit_siblings(self) -> None:
        for rid, siblings in list(self._pending_siblings.items()):
            primary = self._samples[rid][0]
            if primary.num_output_tokens or primary.status.finished:
                # Those still to draw from the primary's kept row wait for it.
                waiting = self._first_tokens.undrawn(rid) if rid in self._first_tokens.rows else []
                if waiting:
                    self._pending_siblings[rid] = waiting
                else:
                    del self._pending_siblings[rid]
                for sibling in (s for s in siblings if s not in waiting):
                    if not sibling.status.finished:  # a first token ended it (FirstTokenDraws.take)
                        self.scheduler.add_request(sibling)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_siblings)

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
        )

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
