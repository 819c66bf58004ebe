"""Shared by the benchmark tests that run a benchmark end to end on a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama folder, made once per test module."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
