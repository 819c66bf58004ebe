"""pagedserve: an LLM inference server on a paged KV cache.

Everything imports as `pagedserve.…`: the planes (`pagedserve.controlplane`,
`pagedserve.dataplane`), the kernels (`pagedserve.kernels`), the wire types
(`pagedserve.protos`), the Python client (`pagedserve.clients.python`), the benchmarks
(`pagedserve.benchmarks`), the product shell (`pagedserve.cli`, `pagedserve.serve`) and the
plane-neutral code (`pagedserve.common`).

`from pagedserve import LLM, SamplingParams` is the offline API. Importing this package is
cheap: the names are resolved on first use, so the control plane (which imports
`pagedserve.common`) never loads torch through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.dataplane.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # The offline API, loaded on first use (LLM pulls in torch and transformers).
    if name == "SamplingParams":
        from pagedserve.common.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from pagedserve.dataplane.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
