"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import EngineConfig, engine_config
from pagedserve.dataplane.engine.llm_engine import LLMEngine
from pagedserve.dataplane.request import PromptLogprob
from pagedserve.dataplane.scheduler import Request

Prompt = str | list[int]
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0)
"""A pooling request's sampling parameters: never read (nothing is sampled) but by admission."""


def complete_text(text: str) -> str:
    """`text` without the U+FFFD its decoder produced for an incomplete trailing UTF-8
    character (a byte-level BPE token can hold part of one): what a stream has sent once the
    same tokens have arrived, since a stream withholds text while it ends in U+FFFD."""
    return text.rstrip("\ufffd")


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence of a prompt (several with n > 1).

    `text` is the decoded `token_ids` without an incomplete trailing UTF-8 character (see
    `complete_text`): the same text a stream of these tokens delivers, never ending in U+FFFD
    where the generation stopped inside a character; `token_ids` keep every token."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # per token, when SamplingParams.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_preemptions: int
    time_to_first_token: float | None
    latency: float
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    # The first completion's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.outputs[0].token_ids)


class LLM:
    """Batch generation on the paged engine, in process. Knob names follow vLLM's `LLM`."""

    def __init__(self, model: str = DEFAULT_MODEL, **settings: Any) -> None:
        """`settings` are EngineConfig's fields by name (dataplane/src/pagedserve/dataplane/config.py), with their
        defaults there: `LLM("SmolLM2-135M-Instruct", block_size=16, max_num_seqs=64, ...)`.
        An unknown name is a TypeError."""
        self.engine = LLMEngine(engine_config(model=model, **settings))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an already built EngineConfig (the CLI's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def reset_prefix_cache(self) -> int:
        """Drop every cached block hash (needed after a weight change); returns how many."""
        return self.engine.kv_cache.reset_prefix_cache()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        `prompts` are strings or token-id lists; `sampling_params` is one object for all or
        one per prompt. Every prompt is validated before any is queued, so a bad one raises
        ValueError and leaves the engine as it was.
        """
        batch = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(batch))
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        token_ids = [self.engine.tokenize(prompt) for prompt in batch]  # ValueError before any is queued
        requests: list[Request] = []
        try:
            for ids, p in zip(token_ids, params, strict=True):
                requests.append(self.engine.add_request(ids, p, cache_salt=cache_salt))
        except ValueError:
            for r in requests:
                self.engine.abort_request(r.request_id)
            raise
        start = time.monotonic()
        self._run(requests, use_tqdm)
        outputs = [self._to_output(r, prompt, start) for r, prompt in zip(requests, batch, strict=True)]
        for r in requests:
            self.engine.release(r.request_id)
        return outputs

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[list[float]]:
        """One embedding per prompt, in prompt order: each prompt computed (prefill only,
        nothing sampled, its blocks freed at once) and its final hidden states pooled as
        `pooling` says (default: the last token's, L2-normalised)."""
        batch = self._as_prompt_list(prompts)
        token_ids = [self.engine.tokenize(prompt) for prompt in batch]  # ValueError before any is queued
        pooling = pooling if pooling is not None else PoolingParams()
        requests: list[Request] = []
        try:
            for ids in token_ids:
                requests.append(self.engine.add_request(ids, PROMPT_ONLY, pooling=pooling))
        except ValueError:
            for r in requests:
                self.engine.abort_request(r.request_id)
            raise
        self._run(requests, use_tqdm=False)
        for r in requests:
            self.engine.release(r.request_id)
        return [r.embedding or [] for r in requests]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.engine.model_path} has no chat template; use generate() instead")
        items: list[Any] = list(messages)
        # One conversation (a list of message dicts) or several.
        conversations: list[list[dict[str, str]]] = [items] if items and isinstance(items[0], dict) else items
        prompts: list[Prompt] = []
        for conv in conversations:
            if not conv:
                raise ValueError("messages must contain at least one message")
            prompts.append(self.apply_chat_template(conv, add_generation_prompt))
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        ids: list[int] = list(out["input_ids"])
        return ids

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        items: list[Any] = list(prompts)
        if not items:
            raise ValueError("prompts must not be empty")
        if all(isinstance(t, int) for t in items):
            return [items]  # one token-id prompt
        return items

    @staticmethod
    def _as_params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        out = list(params)
        if len(out) != n:
            raise ValueError(f"sampling_params has {len(out)} entries for {n} prompts")
        return out

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        pending = {s.request_id for r in requests for s in self.engine.samples_of(r.request_id)}
        bar = tqdm(total=len(pending), desc="generate", unit="seq", disable=not use_tqdm or len(pending) < 2)
        try:
            while pending:
                result = self.engine.step()
                if result.faulted:  # offline, a request's own fault is the caller's error
                    engine_id, error = next(iter(result.faulted.items()))
                    raise RuntimeError(f"request {engine_id} failed in a step: {error}")
                for r in result.finished:
                    if r.request_id in pending:
                        pending.discard(r.request_id)
                        bar.update(1)
                if not result.num_batched_tokens and not result.new_tokens and pending:
                    # The scheduler refuses what can never fit, so an empty step here is a bug.
                    raise RuntimeError(f"scheduler made no progress with {len(pending)} requests pending")
        except BaseException:
            for r in requests:
                self.engine.abort_request(r.request_id)
            raise
        finally:
            bar.close()

    def _to_output(self, r: Request, prompt: Prompt, start: float) -> RequestOutput:
        all_samples = self.engine.samples_of(r.request_id)
        params = r.sampling_params
        samples = all_samples
        if params.num_samples > params.n:  # best_of: keep the n most likely samples
            samples = sorted(all_samples, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[: params.n]
        completions = [
            CompletionOutput(
                index=i,
                text=complete_text(self.engine.decode(s.output_token_ids)),
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason or "abort",
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                top_logprobs=list(s.output_top_logprobs) if params.logprobs else None,
            )
            for i, s in enumerate(samples)
        ]
        ttft = None if r.first_token_time is None else r.first_token_time - max(start, r.arrival_time)
        last_finish = max((s.finish_time or time.monotonic()) for s in all_samples)
        return RequestOutput(
            request_id=r.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=r.prompt_token_ids,
            outputs=completions,
            num_cached_tokens=r.num_cached_tokens,
            prompt_logprobs=None if params.prompt_logprobs is None else [None, *r.prompt_logprobs],
            num_preemptions=sum(s.num_preemptions for s in all_samples),
            time_to_first_token=ttft,
            latency=last_finish - r.arrival_time,
        )
