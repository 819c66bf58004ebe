"""pagedserve data plane: the paged KV block pool, the scheduler and the model runner.

`from dataplane import LLM, SamplingParams` is the offline API. The torch-free parts
(`dataplane.kvcache`, `dataplane.scheduler`, `pagedserve.common.sampling_params`, `dataplane.config`)
import without torch, so the control plane can share them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dataplane.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; load it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from dataplane.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'dataplane' has no attribute {name!r}")
