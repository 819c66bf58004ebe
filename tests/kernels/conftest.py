"""Kernel tests run the Triton kernels on the GPU when there is one, else in Triton's CPU
interpreter. TRITON_INTERPRET must be set before the first @triton.jit module is imported
(kernels.triton_ops is imported lazily, on the first Triton call), hence here."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
