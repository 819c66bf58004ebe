"""The kernel backends a user can choose, by name: the one vocabulary of `--attention-backend`.

A leaf without torch: dataplane.config validates its setting against BACKENDS and must stay
importable without torch (the control plane and the scheduler tests import it), so the names
live here rather than in kernels.backend, which resolves them against a device.
"""

from typing import Literal, get_args

# "torch": the torch reference path (and on the CPU the C++ decode kernel for fp32);
# "triton": the Triton kernels. No choice (None) means by device: kernels.backend.
Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
