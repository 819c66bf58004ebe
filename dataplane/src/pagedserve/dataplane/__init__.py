"""pagedserve data plane: the paged KV block pool, the scheduler and the model runner.

The offline API, `from pagedserve.dataplane import LLM, SamplingParams`, lives here. The torch-free parts
(`pagedserve.dataplane.kvcache`, `pagedserve.dataplane.scheduler`, `pagedserve.common.sampling_params`, `pagedserve.dataplane.config`)
import without torch, so the control plane can share them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.dataplane.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; load it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from pagedserve.dataplane.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pagedserve.dataplane' has no attribute {name!r}")
