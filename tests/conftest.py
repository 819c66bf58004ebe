"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clock import FakeClock


@pytest.fixture()
def clock() -> FakeClock:
    """A clock that moves only when the test calls `clock.advance(seconds)`."""
    return FakeClock()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama folder (config + safetensors, no tokenizer), made once per
    test module."""
    # Imported here: tests/kernels/conftest.py must set TRITON_INTERPRET before anything it
    # pulls in is imported.
    from pagedserve.benchmarks.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def default_model_path() -> Path:
    """The default model's folder in the local store (`make test` pulls it); the test is
    skipped, saying how to fetch it, where it is absent."""
    from pagedserve.common.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (`make pull` fetches it)")
