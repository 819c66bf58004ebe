"""Tenants: API keys map to tenants (keys file), the tenant is part of the cache salt so one
tenant never hits another's cached blocks whatever salt it sends; exactly one Authorization
header on both protocols; /openapi.json behind the keys; the async client's detokenize sends
its key."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.tenancy.auth import (
    ApiKeys,
    load_api_keys,
    load_keys,
    own_tenant,
    read_keys_file,
    request_tenant,
    tenant_salt,
)
from pagedserve.protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.harness import ServerThread, engine_config

KEYS = ("alpha-1", "alpha-2", "bravo-1", "solo")
TENANTS = (("alpha-1", "alpha"), ("alpha-2", "alpha"), ("bravo-1", "bravo"))


@pytest.fixture(scope="module")
def tenanted(tiny: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny), tiny, api_keys=KEYS, api_key_tenants=TENANTS)
    yield srv
    srv.close()


# -- keys files, tenants and salts (no servers) ---------------------------------------------------
def test_keys_files_old_and_tenant_formats(tmp_path: Path) -> None:
    lines = tmp_path / "keys"
    lines.write_text("# team keys\nalpha\n\nteam-a: k1   # rotated\nteam-a:  k2\nweird:key\nalpha\n")
    assert read_keys_file(lines) == [
        ("alpha", None),
        ("k1", "team-a"),
        ("k2", "team-a"),
        ("weird:key", None),  # no space after the colon: an old-format key
        ("alpha", None),
    ]
    assert load_keys(["flag-key"], lines) == (
        ("flag-key", "alpha", "k1", "k2", "weird:key"),
        (("k1", "team-a"), ("k2", "team-a")),
    )
    assert load_api_keys(["flag-key"], lines) == ("flag-key", "alpha", "k1", "k2", "weird:key")

    as_object = tmp_path / "keys.json"
    as_object.write_text(json.dumps({"team-a": ["k1", "k2"], "team-b": "k3"}))
    assert load_keys(key_file=as_object) == (
        ("k1", "k2", "k3"),
        (("k1", "team-a"), ("k2", "team-a"), ("k3", "team-b")),
    )
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(["k0", {"key": "k1", "tenant": "team-a"}]))
    assert load_keys(key_file=as_list) == (("k0", "k1"), (("k1", "team-a"),))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a: k1\nb: k1\n", "two tenants"),
        ("key-0123: k1\n", "tenant"),  # the prefix of keys' own tenants is reserved
        ("bad tenant: k1\n", "without spaces"),
        ('{"a": 5}', "non-empty string"),
        ("{not json", "invalid JSON"),
    ],
)
def test_bad_keys_files_are_one_clear_error(tmp_path: Path, text: str, error: str) -> None:
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_keys(key_file=f)
    with pytest.raises(ValueError, match="no such file"):
        load_keys(key_file=tmp_path / "missing")


def test_keys_authenticate_to_their_tenant() -> None:
    keys = ApiKeys(KEYS, dict(TENANTS))
    assert keys.authenticate(["Bearer alpha-1"]) == keys.authenticate(["bearer alpha-2"]) == "alpha"
    assert keys.authenticate(["Bearer bravo-1"]) == "bravo"
    assert keys.authenticate(["Bearer solo"]) == own_tenant("solo") != own_tenant("alpha-1")
    assert "solo" not in own_tenant("solo")  # a key's own tenant never spells the key
    for refused in (
        [],
        ["Bearer alpha-1", "Bearer alpha-1"],
        ["Bearer nope"],
        ["alpha-1"],
        [""],
        ["Basic solo"],
    ):
        assert keys.authenticate(refused) is None, refused
    assert keys.check_header("Bearer solo") and not keys.check_header(None)


def test_the_tenant_namespaces_the_salt() -> None:
    assert tenant_salt(None, "s") == "s" and tenant_salt(None, None) is None  # keys off: as sent
    a, b = tenant_salt("a", "s"), tenant_salt("b", "s")
    assert a != b and a is not None and b is not None
    assert tenant_salt("a", None) == tenant_salt("a", "") != tenant_salt("b", None)
    # Sending another tenant's derived salt does not reach its blocks.
    assert tenant_salt("b", a) not in (a, b)
    # No separator games: the pair is encoded, not joined.
    assert tenant_salt("a:b", "c") != tenant_salt("a", "b:c")
    assert request_tenant() is None


def test_tenants_need_their_keys() -> None:
    with pytest.raises(ValueError, match="not in api_keys"):
        ControlPlaneConfig(dataplanes=("127.0.0.1:1",), api_keys=("k",), api_key_tenants=(("other", "t"),))


# -- against a server -----------------------------------------------------------------------------
def cached_grpc(srv: ServerThread, prompt: list[int], key: str, salt: str | None) -> int:
    with GenerationClient(srv.grpc_address, api_key=key, timeout=30) as client:
        (done,) = client.generate(prompt, max_tokens=1, cache_salt=salt or "")
        return done.cached_tokens


def cached_http(srv: ServerThread, prompt: list[int], key: str, salt: str | None) -> int:
    client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key=key, max_retries=0)
    extra = {} if salt is None else {"cache_salt": salt}
    out = client.completions.create(
        model=srv.controlplane.dispatcher.config.model, prompt=prompt, max_tokens=1, extra_body=extra
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_one_tenant_never_hits_another_tenants_blocks(tenanted: ServerThread, protocol: str) -> None:
    cached = cached_grpc if protocol == "grpc" else cached_http
    rng = random.Random(protocol)
    prompt = [rng.randrange(3, 380) for _ in range(40)]  # two full 16-token blocks
    assert cached(tenanted, prompt, "alpha-1", "shared") == 0
    assert cached(tenanted, prompt, "alpha-2", "shared") == 32  # same tenant, another key: a hit
    assert cached(tenanted, prompt, "bravo-1", "shared") == 0  # same salt and prompt, other tenant
    assert cached(tenanted, prompt, "solo", "shared") == 0  # a key without a named tenant is its own
    assert cached(tenanted, prompt, "bravo-1", None) == 0
    assert cached(tenanted, prompt, "bravo-1", "shared") == 32  # its own blocks it does hit
    tenanted.wait_idle()


def test_duplicate_authorization_is_refused_on_grpc(tenanted: ServerThread) -> None:
    request = generation_pb2.TokenizeRequest(text="x")
    with grpc.insecure_channel(tenanted.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for values in (["alpha-1", "alpha-1"], ["alpha-1", "nope"], ["nope", "alpha-1"]):
            metadata = [("authorization", f"Bearer {v}") for v in values]
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(request, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, values
            assert "exactly one" in (err.value.details() or "")
            stream = stub.Generate(generation_pb2.GenerateRequest(), metadata=metadata, timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(iter(stream))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # One good header passes the check (and reaches the service).
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(request, metadata=[("authorization", "Bearer alpha-1")], timeout=10)
        assert err.value.code() != grpc.StatusCode.UNAUTHENTICATED


def _post(srv: ServerThread, path: str, headers: list[tuple[str, str]], body: bytes) -> int:
    host, port = srv.http_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in [
            *headers,
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_duplicate_authorization_is_refused_on_http(tenanted: ServerThread) -> None:
    model = tenanted.controlplane.dispatcher.config.model
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 1}).encode()
    assert _post(tenanted, "/v1/completions", [("authorization", "Bearer alpha-1")], body) == 200
    for values in (["alpha-1", "alpha-1"], ["alpha-1", "nope"], ["nope", "alpha-1"]):
        headers = [("authorization", f"Bearer {v}") for v in values]
        assert _post(tenanted, "/v1/completions", headers, body) == 401, values


def test_openapi_json_needs_a_key(tenanted: ServerThread) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{tenanted.http_url}/openapi.json", timeout=10)
    assert err.value.code == 401
    request = urllib.request.Request(
        f"{tenanted.http_url}/openapi.json", headers={"authorization": "Bearer solo"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_the_async_client_sends_its_key_on_every_call(tenanted: ServerThread) -> None:
    async def run() -> None:
        async with AsyncGenerationClient(tenanted.grpc_address, api_key="solo", timeout=30) as client:
            assert isinstance(await client.detokenize([5, 6, 7]), str)
            assert await client.list_models()
            assert (await client.generate([5, 6, 7], max_tokens=1))[0].completion_tokens == 1
        async with AsyncGenerationClient(tenanted.grpc_address, timeout=30) as keyless:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await keyless.detokenize([5, 6, 7])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(run())
