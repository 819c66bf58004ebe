"""Runs one scheduler step: flatten the batch, run the model once, sample."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.common.log import get_logger
from pagedserve.dataplane.config import ModelConfig
from pagedserve.dataplane.models import CausalLM, PagedStep
from pagedserve.dataplane.runner.cpu_linear import onednn_linear_available, pack_linears
from pagedserve.dataplane.runner.kv_scales import KVScales
from pagedserve.dataplane.runner.linear_selection import ShapeChoice, select_linears
from pagedserve.dataplane.runner.pooling import PoolRows, add_pooled, pool_rows
from pagedserve.dataplane.runner.prompt_logprobs import PromptRows, add_prompt_logprobs, prompt_rows
from pagedserve.dataplane.runner.quant_linear import int8_activations, pack_quant_linears
from pagedserve.dataplane.runner.sampler import SampledToken, SamplerWork, accept_drafts, sample
from pagedserve.dataplane.scheduler import Request, SchedulerOutput
from pagedserve.dataplane.scheduler.output import ScheduledRequest
from pagedserve.kernels import build_attention_metadata, swap_blocks
from pagedserve.kernels.backend import resolve_backend
from pagedserve.kernels.cpu_ext import CpuKernels, load_cpu_kernels
from pagedserve.kernels.fp8 import is_fp8

log = get_logger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs as plain integers: all that a tensor-parallel rank needs to run
    the step's forward in lockstep with rank 0 (dataplane/src/pagedserve/dataplane/parallel/step_plan.py packs it).

    `swap_out`/`swap_in`: (device, host) / (host, device) block pairs to copy before the forward.
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the physical KV tensors (one K and one V tensor per layer).

    kv_dtype is the pool's element type: the model's dtype, or an FP8 dtype, which needs
    kv_scales (one K and one V scale per layer).

    With `num_host_blocks` it also owns the host pool's tensors (the same layout on the CPU,
    pinned next to a GPU), which `swap` copies blocks into and out of.

    `config` (ModelConfig) gives the device, the sampling seed and the kernel choices
    (attention backend, CPU linear kernels and weight dtype, quantized matmul).

    Tensor parallelism: the model comes already sharded (dataplane/src/pagedserve/dataplane/parallel/sharding.py), so
    the pool holds this rank's 1/`tensor_parallel_size` of the KV heads. On rank 0,
    `step_listener` receives each forward's `StepInputs` (with the swaps made since the last
    forward) before the forward runs, to hand them to the other ranks; those run
    `execute_inputs`.
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        *,
        kv_scales: KVScales | None = None,
        num_host_blocks: int = 0,
        tensor_parallel_size: int = 1,
        step_listener: Callable[[StepInputs], None] | None = None,
    ) -> None:
        self.model = model
        self.step_listener = step_listener
        # Swaps made since the last forward, for the next StepInputs (the other ranks copy
        # them just before that forward: no forward in between reads or writes those blocks).
        self._pending_swap_out: list[tuple[int, int]] = []
        self._pending_swap_in: list[tuple[int, int]] = []
        self.device = torch.device(config.device)
        attention_backend, seed = config.attention_backend, config.seed
        # The one place the backend choice meets the device and dtypes: every step's layers
        # get these concrete implementations. Resolving also builds (or loads the cached
        # build of) the C++ decode kernel where it is used, now rather than in the first step.
        self.backends = resolve_backend(attention_backend, self.device, model.dtype, kv_dtype)
        # (in, out) -> the kernel per row band of the packed fp32 CPU linears (empty: none)
        self.linear_choices: dict[tuple[int, int], ShapeChoice] = {}
        # After any tensor-parallel sharding (the packed shapes are the local ones).
        cpu_ops = self._layer_kernels(model)
        with_ops = model.use_cpu_kernels(cpu_ops)
        if cpu_ops is not None or onednn_linear_available(model.dtype, self.device):
            bf16 = config.cpu_weight_dtype == "bfloat16"
            self.linear_choices = select_linears(model, cpu_ops, config.cpu_linear, bf16_weights=bf16)
            pack_linears(model, panel_ops=cpu_ops, choices=self.linear_choices, bf16_weights=bf16)
            # a GGUF model's quantized linears, or --quantization int8's
            int8 = int8_activations(config.quantized_matmul, cpu_ops)
            pack_quant_linears(model, cpu_ops, int8_activations=int8)
        attention_input, mlp = model.bind_block_kernels()
        log.info(
            "model_layers",
            implementation=model.implementation,
            layers=model.num_layers,
            cpu_elementwise_kernels=with_ops,
            attention_input_block_ops=attention_input,
            mlp_block_ops=mlp,
        )
        self.block_size = block_size
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.tensor_parallel_size = tensor_parallel_size
        self.num_kv_heads: int = cfg.num_key_value_heads // tensor_parallel_size  # this rank's
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if is_fp8(kv_dtype) and (kv_scales is None or kv_scales.num_layers != self.num_layers):
            raise ValueError(f"an FP8 KV cache needs k/v scales for each of the {self.num_layers} layers")
        self.kv_scales = kv_scales.per_layer() if is_fp8(kv_dtype) and kv_scales is not None else None
        # kv_caches[layer] = (key_cache, value_cache): [num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        # The host pool: never read before a swap-out wrote it, so left uninitialised (on the
        # CPU its pages are only committed as swap-outs touch them).
        host_shape = (num_host_blocks, block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.host_kv_caches = [
            (
                torch.empty(host_shape, dtype=kv_dtype, pin_memory=pin),
                torch.empty(host_shape, dtype=kv_dtype, pin_memory=pin),
            )
            for _ in range(self.num_layers if num_host_blocks else 0)
        ]
        self._seed_rng = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._token_masks: Any = None  # structured outputs' bitmask, allocated on first use
        self.mask_seconds = 0.0  # time steps waited for grammar masks (fill rest + masking)
        self.sample_work = SamplerWork()  # the sampler's whole-vocabulary work, counted
        # The last execute's logits rows of the requests given riders, for later draws (`draw`).
        self.kept_rows: dict[str, torch.Tensor] = {}

    def _layer_kernels(self, model: CausalLM) -> CpuKernels | None:
        """The C++ kernels for the fused layers' elementwise work and the panel-packed
        linears: on the CPU in fp32, where they build (the same build as the C++ decode
        attention; None logs once, and the layers use torch ops and oneDNN's linears)."""
        if self.device.type != "cpu" or model.dtype != torch.float32:
            return None
        return load_cpu_kernels()

    def _generator_for(self, request: Request, offset: int) -> torch.Generator:
        """The generator of a drawn sample's token at output position `num_output_tokens +
        offset`. A seeded request's draw depends on its seed and that position only, so it
        draws the same token from the same distribution however its steps are cut (drafted
        runs verified or not, preempted or not): its text repeats exactly."""
        seed = request.sampling_params.seed
        if seed is not None:
            gen = torch.Generator(device=self.device)
            position = request.num_output_tokens + offset
            gen.manual_seed((seed * 0x9E3779B97F4A7C15 + position) & (2**63 - 1))
            return gen
        own = self._generators.get(request.request_id)
        if own is None:
            own = torch.Generator(device=self.device)
            own.manual_seed(self._seed_rng.getrandbits(63))
            self._generators[request.request_id] = own
        return own

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Make a step's block copies with the kernels' swap op: (device, host) pairs out,
        then (host, device) pairs in. Returns once they are done (on a GPU: synchronised)."""
        if not swap_out and not swap_in:
            return
        if self.step_listener is not None:
            # The workers replay a forward's swaps as all outs, then all ins. Swaps pend across
            # steps only while no forward runs, and a step that swaps in always runs one (the
            # request swapped in is scheduled), so an out never follows a pending in; if one
            # did, replaying it before that in would copy stale blocks.
            if swap_out and self._pending_swap_in:
                raise RuntimeError("a swap-out after a pending swap-in cannot be replayed in order")
            self._pending_swap_out.extend(swap_out)
            self._pending_swap_in.extend(swap_in)
        self._copy_blocks(swap_out, swap_in)

    def _copy_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if not swap_out and not swap_in:
            return
        if not self.host_kv_caches:
            raise RuntimeError("swap requested but the runner has no host pool")
        device = [c for kv in self.kv_caches for c in kv]
        host = [c for kv in self.host_kv_caches for c in kv]
        if swap_out:
            swap_blocks(device, host, swap_out, impl=self.backends.cache)
        if swap_in:
            swap_blocks(host, device, swap_in, impl=self.backends.cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, riders: Mapping[str, Sequence[Request]] | None = None
    ) -> dict[str, SampledToken]:
        """Compute the scheduled tokens of every request; return the sampled token per request
        whose computed tokens reach its total this step. Requests asking for prompt logprobs
        get those of the prompt tokens this step's rows predict (`prompt_logprobs`); pooling
        requests fold their rows into their embedding (`pooling`) and sample nothing.

        `riders`: scheduled request id -> requests not in the step whose next token is drawn
        from that request's logits row too (the other samples of its prompt, first tokens:
        LLMEngine), each with its own parameters and generator; their tokens are returned
        under their ids. They add no row to the forward or the LM head, and the sampler's
        work over the vocabulary is shared by the samples of one row. The row of each request
        in `riders` is kept in `kept_rows` (until the next execute), for `draw` in later steps."""
        self.kept_rows = {}
        inputs = StepInputs([], [], [], [], [])
        sample_rows: list[int] = []
        scored: list[PromptRows] = []  # rows whose prompt logprobs are asked for
        pooled: list[PoolRows] = []  # pooling requests' rows
        for item in out.scheduled:
            r = item.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + item.num_new_tokens
            _note_prompt_rows(r, len(inputs.input_ids), start, end, scored, pooled)
            inputs.input_ids.extend(r.all_token_ids[start:end])
            inputs.input_ids.extend(item.spec_token_ids)  # (drafts: past the known tokens)
            inputs.positions.extend(range(start, end))
            if item.spec_token_ids:
                # A drafted run is attended as one decode row per token, each over the context
                # up to itself (the causal mask of a short query, exactly): the decode kernels
                # read the paged cache in place, where a prefill path would gather the whole
                # context for a few query rows.
                inputs.query_lens.extend([1] * item.num_new_tokens)
                inputs.seq_lens.extend(range(start + 1, end + 1))
                inputs.block_tables.extend([r.block_table] * item.num_new_tokens)
            else:
                inputs.query_lens.append(item.num_new_tokens)
                inputs.seq_lens.append(end)
                inputs.block_tables.append(r.block_table)
            if item.samples:  # a drafted run samples at its last known token and every draft
                sample_rows.extend(
                    range(len(inputs.input_ids) - 1 - len(item.spec_token_ids), len(inputs.input_ids))
                )
        if self.step_listener is not None:
            inputs.swap_out.extend(self._pending_swap_out)
            inputs.swap_in.extend(self._pending_swap_in)
            self._pending_swap_out, self._pending_swap_in = [], []
            self.step_listener(inputs)
        sampling = [s for s in out.scheduled if s.samples]
        first_rows = list(itertools.accumulate((1 + len(s.spec_token_ids) for s in sampling), initial=0))
        constrained = [
            (first_rows[i] + j, grammar if j == 0 else grammar.after(s.spec_token_ids[:j]))
            for i, s in enumerate(sampling)
            if (grammar := s.request.grammar) is not None
            for j in range(1 + len(s.spec_token_ids))
        ]
        filled = self._start_mask_fill(constrained) if constrained else None  # overlaps the forward
        hidden = self._forward(inputs)
        self._read_prompt_rows(hidden, scored, pooled)
        if not sample_rows:
            return {}
        index = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index)).float()  # [N, vocab]
        if constrained:
            self._mask_logits(logits, constrained, filled)
        return self._sample_step(logits, sampling, first_rows, riders)

    def _sample_step(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledRequest],
        first_rows: list[int],
        riders: Mapping[str, Sequence[Request]] | None,
    ) -> dict[str, SampledToken]:
        """The step's tokens from its logits rows: each sampling request's (a drafted run:
        one per row, then verified, `accept_drafts`), then its riders' from its first row."""
        samples = [s.request for s in sampling for _ in range(1 + len(s.spec_token_ids))]
        rows = list(range(len(samples)))
        for i, s in enumerate(sampling):
            if riders and s.request.request_id in riders:
                row = first_rows[i]
                self.kept_rows[s.request.request_id] = logits[row].clone()
                samples.extend(riders[s.request.request_id])
                rows.extend([row] * len(riders[s.request.request_id]))
        tokens = self._sample_rows(logits, samples, rows)
        end = first_rows[-1]
        result = {r.request_id: t for r, t in zip(samples[end:], tokens[end:], strict=True)}
        for i, s in enumerate(sampling):
            run = tokens[first_rows[i] : first_rows[i + 1]]
            result[s.request.request_id] = (
                accept_drafts(s.spec_token_ids, run) if s.spec_token_ids else run[0]
            )
        return result

    def _read_prompt_rows(
        self, hidden: torch.Tensor, scored: list[PromptRows], pooled: list[PoolRows]
    ) -> None:
        """After the forward: the prompt logprobs and pooled rows the step's requests asked for."""
        if scored:
            add_prompt_logprobs(hidden, scored, self.model.compute_logits)
        if pooled:
            add_pooled(hidden, pooled)

    @torch.inference_mode()
    def draw(self, row: torch.Tensor, requests: Sequence[Request]) -> dict[str, SampledToken]:
        """The next token of each of `requests` drawn from one logits row [vocab] (a kept row:
        `kept_rows`), each with its own parameters and generator; no forward."""
        return self._sample(row.unsqueeze(0), list(requests), [0] * len(requests))

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int]
    ) -> dict[str, SampledToken]:
        """Request i's next token from row `rows[i]` of logits [R, vocab] (`sample`)."""
        tokens = self._sample_rows(logits, requests, rows)
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int]
    ) -> list[SampledToken]:
        """The token of each of `requests` (one may be listed once per row it samples, in row
        order: a drafted run, whose draws then follow each other in its generator)."""
        params = [r.sampling_params for r in requests]
        offsets = [0] * len(requests)
        for i in range(1, len(requests)):
            if requests[i] is requests[i - 1]:
                offsets[i] = offsets[i - 1] + 1  # the next row of a drafted run
        generators: list[torch.Generator | None] = [
            None if p.greedy else self._generator_for(r, offset)
            for r, p, offset in zip(requests, params, offsets, strict=True)
        ]
        no_history: tuple[list[int], list[int]] = ([], [])
        histories = [
            (r.prompt_token_ids, r.output_token_ids) if p.needs_history else no_history
            for r, p in zip(requests, params, strict=True)
        ]
        eos = [r.eos_token_id for r in requests]
        return sample(logits, params, generators, histories, rows, self.sample_work, eos)

    def _start_mask_fill(self, rows: list[tuple[int, Any]]) -> Any:
        """Structured outputs: start filling the constrained rows' token bitmask, on a worker
        thread while the forward runs (pagedserve.dataplane.structured.grammar.TokenMasks)."""
        if self._token_masks is None:
            from pagedserve.dataplane.structured.grammar import TokenMasks  # imports xgrammar: only when used

            self._token_masks = TokenMasks(self.model.config.vocab_size)
        return self._token_masks.start_fill(rows)

    def fill_masks_ahead(self, scheduled: Sequence[Any]) -> None:
        """Structured outputs: start filling the step's unfinished constrained samples' next
        masks now, just after their tokens were accepted, so the fill overlaps the engine's
        bookkeeping rather than the next forward (TokenMasks.fill_ahead). Nothing (not even a
        pass over the step) before the first constrained step."""
        if self._token_masks is None:
            return
        grammars = [
            item.request.grammar
            for item in scheduled
            if item.request.grammar is not None and not item.request.status.finished
        ]
        if grammars:
            self._token_masks.fill_ahead(grammars)

    def _mask_logits(self, logits: torch.Tensor, rows: list[tuple[int, Any]], filled: Any) -> None:
        """Each constrained row keeps only the tokens its grammar allows next (the others
        become -inf), in place, before penalties and sampling; a constrained row's logprobs are
        therefore those of the allowed tokens, renormalised. Unconstrained rows are not
        touched. `mask_seconds` counts what the step waits for: the rest of the fill after
        the forward, and the masking."""
        started = time.perf_counter()
        self._token_masks.apply(logits, rows, filled)
        self.mask_seconds += time.perf_counter() - started

    @property
    def mask_fill_seconds(self) -> float:
        """The bitmask fills' own time (on the worker thread, overlapping the forwards)."""
        return 0.0 if self._token_masks is None else float(self._token_masks.fill_seconds)

    def close(self) -> None:
        """Stop the mask worker thread, if one started."""
        if self._token_masks is not None:
            self._token_masks.close()

    @torch.inference_mode()
    def execute_inputs(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's step: rank 0's swaps, then the same forward (rank 0
        alone computes logits and samples)."""
        self._copy_blocks(inputs.swap_out, inputs.swap_in)
        self._forward(inputs)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The decoder over the flattened batch; returns the last hidden states [T, hidden]."""
        meta = build_attention_metadata(
            inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.block_size, self.device
        )
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        step = PagedStep(meta, self.kv_caches, self.backends, kv_scales=self.kv_scales)
        hidden: torch.Tensor = self.model(ids, pos, step)
        return hidden


def _note_prompt_rows(
    request: Request, first_row: int, start: int, end: int, scored: list[PromptRows], pooled: list[PoolRows]
) -> None:
    """Before the forward: the rows of `request`'s positions [start, end) (from flattened row
    `first_row`) that score prompt logprobs or feed its pooling, if it asks for either."""
    wanted = prompt_rows(request, first_row, start, end)
    if wanted is not None:
        scored.append(wanted)
    rows = pool_rows(request, first_row, start, end)
    if rows is not None:
        pooled.append(rows)
