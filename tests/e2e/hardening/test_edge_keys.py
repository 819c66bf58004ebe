"""The edge behind API keys: the tokenizer routes and /version need a key like the OpenAI API
(the probes stay open), a refused request is in OpenAI's error JSON, and the body limit and
the error shapes still hold through the key check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.hardening.tiny_served import Http, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(model), model, api_keys=("alpha",))
    yield srv
    srv.wait_idle()
    srv.close()


def test_tokenizer_routes_and_version_need_a_key(keyed: ServerThread) -> None:
    http = Http(keyed.http_url)
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})]:
        reply = http.post(path, body)
        assert reply.status == 401
        assert reply.json()["error"]["code"] == "unauthenticated"
        ok = http.request("POST", path, '{"prompt": "hi", "tokens": [5]}', {"authorization": "Bearer alpha"})
        assert ok.status == 400  # the key is fine; the body was not sent as JSON
        assert ok.json()["error"]["message"] == (
            "the request body must be JSON, sent with content-type: application/json (got none)"
        )
        headers = {"authorization": "Bearer alpha", "content-type": "application/json"}
        ok = http.request("POST", path, '{"prompt": "hi", "tokens": [5]}', headers)
        assert ok.status == 200, ok.text
    assert http.get("/version").status == 401
    assert http.request("GET", "/version", headers={"authorization": "Bearer alpha"}).status == 200
    assert http.get("/live").status == 200


def test_the_body_limit_and_errors_hold_behind_the_key_check(keyed: ServerThread) -> None:
    http = Http(keyed.http_url)
    auth = {"authorization": "Bearer alpha", "content-type": "application/json"}
    big = http.request("POST", "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}', auth)
    assert big.status == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = http.request("POST", "/v1/completions", '{"prompt": ', auth)
    assert bad.status == 400 and bad.json()["error"]["param"] is None
    ok = http.request("POST", "/v1/completions", '{"prompt": "Say hi", "max_tokens": 2}', auth)
    assert ok.status == 200, ok.text
    assert ok.json()["model"] == Path(keyed.controlplane.dispatcher.config.model).name
