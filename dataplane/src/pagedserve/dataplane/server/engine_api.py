"""What an engine loop is built from: the engine it drives and the identity it reports.

Imports no torch: the engine's types are for the type checker only, so tests can drive the
loop with a light fake engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.common.constraints import Constraint
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.engine.outputs import EngineStats, StepResult
from pagedserve.dataplane.kvcache import BlockHash, KVEventRecord
from pagedserve.dataplane.request import Request
from pagedserve.protos.pagedserve.v1 import dataplane_pb2


class GrammarCompiler(Protocol):
    """Compiles a constraint off the caller's thread (dataplane/src/pagedserve/dataplane/structured/compile_service.py)."""

    def submit(self, constraint: Constraint, done: Callable[[Any, Any], None]) -> None: ...


class Engine(Protocol):
    """What the loop needs from LLMEngine (tests may pass a lighter engine)."""

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        grammar: Any = None,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
        pooling: PoolingParams | None = None,
    ) -> Request: ...

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler; raises ValueError when the model cannot have one."""
        ...

    def samples_of(self, request_id: str) -> list[Request]: ...

    def release(self, request_id: str) -> None: ...

    def abort_request(self, request_id: str) -> Request | None: ...

    def abort_sample(self, request_id: str, index: int) -> Request | None: ...

    def step(self) -> StepResult: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def take_kv_events(self) -> list[KVEventRecord]: ...

    def cached_block_hashes(self) -> set[BlockHash]: ...


@dataclass(frozen=True)
class DataPlaneIdentity:
    """What the loop reports about itself in snapshots."""

    dataplane_id: str
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    prefix_hash_seed: str
    enable_prefix_caching: bool
    kv_cache_dtype: str
    vocab_size: int

    def to_proto(self) -> dataplane_pb2.DataPlaneInfo:
        # abort_sample: this loop honours AbortCommand.index; pooling: it runs
        # SubmitCommand.pooling (the control plane checks both).
        return dataplane_pb2.DataPlaneInfo(**self.__dict__, abort_sample=True, pooling=True)
