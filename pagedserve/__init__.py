"""pagedserve: an LLM inference server on a paged KV cache.

This package is the product shell (the `pagedserve` command: `cli`, `serve`, `models_cli`)
and, in `pagedserve.common`, the plane-neutral code both planes import. Importing it is
cheap: nothing here imports a plane, torch or gRPC.
"""

__version__ = "0.1.0"
