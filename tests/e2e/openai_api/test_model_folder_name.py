"""A model from a local folder is served under the folder's name (real servers, a tiny model):
`/v1/models` lists `tiny-qwen2`, not the path; the path as given is still accepted as `model`;
`--served-model-name` wins over both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.controlplane.config import model_names
from tests.e2e.hardening.tiny_served import Http, Reply, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def serve(model: Path, **cp_kwargs: Any) -> Iterator[Http]:
    srv = ServerThread(engine_config(model, num_blocks=32, max_model_len=128), model, **cp_kwargs)
    try:
        yield Http(srv.http_url)
    finally:
        srv.close()


@pytest.fixture(scope="module")
def http(model: Path) -> Iterator[Http]:
    yield from serve(model)


def completion(http: Http, model: str) -> Reply:
    return http.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})


def test_v1_models_lists_the_folder_name(http: Http) -> None:
    listed = http.get("/v1/models")
    assert listed.status == 200, listed.text
    assert [card["id"] for card in listed.json()["data"]] == ["tiny-qwen2"]
    assert http.get("/v1/models/tiny-qwen2").status == 200


def test_the_folder_name_and_the_full_path_are_both_accepted(http: Http, model: Path) -> None:
    for name in ("tiny-qwen2", str(model)):
        reply = completion(http, name)
        assert reply.status == 200, reply.text
        assert reply.json()["model"] == "tiny-qwen2"  # what the server reports is the name


def test_another_name_is_404_naming_the_served_name(http: Http) -> None:
    reply = completion(http, "tiny-llama")
    assert reply.status == 404, reply.text
    error = reply.json()["error"]
    assert error["param"] == "model" and "'tiny-qwen2'" in error["message"], error


def test_served_model_name_wins(model: Path) -> None:
    for http in serve(model, served_model_names=("alias",)):
        assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["alias"]
        assert completion(http, "alias").json()["model"] == "alias"
        for other in ("tiny-qwen2", str(model)):
            assert completion(http, other).status == 404


def test_the_names_of_each_kind_of_model() -> None:
    assert model_names("SmolLM2-135M-Instruct") == (("SmolLM2-135M-Instruct",), ())
    assert model_names("/data/models/tiny-qwen2/") == (("tiny-qwen2",), ("/data/models/tiny-qwen2/",))
    assert model_names("./qwen2.5-0.5b-q8_0.gguf") == (("qwen2.5-0.5b-q8_0",), ("./qwen2.5-0.5b-q8_0.gguf",))
    assert model_names("/m/x", ("a", "b")) == (("a", "b"), ())
