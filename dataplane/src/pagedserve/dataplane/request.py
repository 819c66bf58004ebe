"""The request-state object: token ids, computed-token count and block table. Imports no torch.

A leaf of the data plane (as nano-vllm's sequence.py): the block accounting (kvcache) and the
scheduler both import it, and it imports neither.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.common.block_hash import BlockHash


class OutputGrammar(Protocol):
    """A sample's structured-output matcher, as the scheduler sees it (dataplane/src/pagedserve/dataplane/structured
    implements it; the scheduler stays free of the grammar backend)."""

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False if the grammar does not allow it."""
        ...

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        ...

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` (speculative decoding) the grammar allows from here, in order."""
        ...

    def after(self, drafts: Sequence[int]) -> object:
        """What fills the token mask of the row after `drafts` (which the grammar allows)."""
        ...


class PromptLogprob(NamedTuple):
    """One prompt token's log-probability given its prefix (`SamplingParams.prompt_logprobs`):
    its rank among the vocabulary (1 = most likely) and the `prompt_logprobs` most likely
    tokens at its position, as (token id, logprob)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV blocks wait in the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    """One sequence being generated.

    The scheduler advances `num_computed_tokens` towards `num_tokens` (prompt plus generated
    tokens): a prefill, a chunk of one, a decode step or a recompute after preemption are all
    the same operation. `block_table` is append-only while the request holds its blocks.

    `cache_salt` isolates prefix-cache sharing: requests with different salts (or one with
    a salt and one without) never share a block. `num_cached_tokens` is how many prompt
    tokens the prefix cache served at first admission; `block_hashes` are the chained
    hashes of its full blocks, filled in by the KV cache manager.

    While preempted by swap (status SWAPPED) the request holds no device blocks: its
    `host_block_table` lists the host-pool blocks its KV was copied into, one per block of
    its computed tokens, and `num_computed_tokens` is kept; swapping back in empties it.

    `priority` orders the scheduler's queues (lower first, vLLM's semantics; 0 by default).
    The scheduler keeps `queued_at`, when the request last entered its waiting or swapped queue
    (None while it runs), and `waited_s`, its time queued before that: its aging
    (dataplane/src/pagedserve/dataplane/scheduler/priority.py) counts queued time only.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.host_block_table: list[int] = []
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.priority = priority
        # Its tenant ("" when none was named) and the tenant's weight: with two or more tenants
        # present the scheduler shares the batch between them (dataplane/src/pagedserve/dataplane/scheduler/fair_share.py).
        self.tenant = tenant
        self.tenant_weight = tenant_weight
        self.queued_at: float | None = None
        self.waited_s = 0.0
        # Filled by the engine when the sampling params ask for logprobs (or best_of ranking).
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # Filled by the runner when the sampling params ask for prompt logprobs: entry i is
        # prompt token i + 1's (the first token has no prefix to be predicted from).
        self.prompt_logprobs: list[PromptLogprob] = []
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # Structured output: this sample's matcher (the engine sets it); it advances on each
        # token appended, and only then, so preemption and recompute leave it in step.
        self.grammar: OutputGrammar | None = None
        # A sample whose first token was drawn from its primary's logits row, before it computed
        # its prompt (LLMEngine, parallel sampling): its prompt's end, until it is computed.
        self.first_chunk_end: int | None = None
        # Speculative decoding: tokens drafted to follow its last token, verified in its next
        # step (dataplane/speculative); never part of `all_token_ids` until accepted.
        self.spec_token_ids: list[int] = []
        self.num_spec_drafted = 0  # drafted tokens verified, and those accepted
        self.num_spec_accepted = 0
        # A pooling (embedding) request: prompt-only, nothing sampled; it ends once its prompt
        # is computed. The runner keeps its running pool in `pooling_state` (opaque here) and
        # leaves the vector in `embedding` (dataplane/runner/pooling.py).
        self.pooling: PoolingParams | None = None
        self.pooling_state: Any = None
        self.embedding: list[float] | None = None

    @property
    def computes_every_prompt_row(self) -> bool:
        """Whether each prompt position must be computed here rather than served by the prefix
        cache: prompt logprobs score every position, mean and cls pooling read their rows."""
        if self.sampling_params.prompt_logprobs is not None:
            return True
        return self.pooling is not None and self.pooling.needs_every_row

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def compute_end(self) -> int:
        """The token the scheduler computes this request's next chunks up to: its last token,
        except for a sample whose first token was drawn before its prompt was computed, whose
        prompt is computed first (without sampling) and the token then decoded alone: the
        steps, and so the arithmetic, of a sample that computes its prompt and samples itself."""
        end = self.first_chunk_end
        return end if end is not None and self.num_computed_tokens < end else self.num_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(self.output_logprobs) if self.output_logprobs else None

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}"
            + (f", host_blocks={self.host_block_table})" if self.host_block_table else ")")
        )
