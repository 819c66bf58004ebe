"""One tiny random-weight model served (with a tokenizer and a chat template) behind two API
keys, each a tenant of its own, for the APIs agents speak (Anthropic's Messages, OpenAI's
Responses), each driven by its real client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

CONTEXT = 1024
KEY, OTHER_KEY = "alpha", "beta"


@pytest.fixture(scope="package")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="package")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        engine_config(model, num_blocks=256, max_model_len=CONTEXT), model, api_keys=(KEY, OTHER_KEY)
    )
    yield srv
    idle = srv.wait_idle()  # whatever was refused, served or streamed: every block is free again
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()
