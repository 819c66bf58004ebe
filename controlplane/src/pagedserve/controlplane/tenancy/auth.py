"""API keys and tenants for the public endpoints: `Authorization: Bearer <key>` on HTTP, and the
same `authorization` metadata on gRPC; exactly one such header, never two. Health probes and
/metrics stay open.

Every key belongs to a tenant: the one its keys file names (`tenant-a: key1`), else a tenant
of its own. The authenticated tenant travels with the request (`request_tenant()`, set by the
gRPC interceptor and the HTTP middleware for the duration of the call) and becomes part of the
request's cache salt (`tenant_salt`), so a tenant can never hit another tenant's cached blocks,
whatever salt it sends.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedserve.common.tls import deny_like, metadata_values
from pagedserve.controlplane.tenancy.tenants import (
    DEFAULT_TENANT,
    EVERY_TENANT,
    TenantPolicy,
    json_settings,
    merge_settings,
    settings_line,
)

PROTECTED_GRPC_PREFIX = "/pagedserve.v1.GenerationService/"
# With keys configured, every HTTP path but these needs one (the OpenAI API, /openapi.json, ...).
PUBLIC_HTTP_PATHS = frozenset({"/health", "/live", "/metrics"})
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"
DUPLICATE_AUTHORIZATION_MESSAGE = (
    "several authorization headers: send exactly one 'authorization: Bearer <key>'"
)

# A key without a named tenant is a tenant of its own, named after a digest of the key (never
# the key itself); named tenants may not use this prefix, so they cannot alias one.
OWN_TENANT_PREFIX = "key-"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_TENANT_LINE = re.compile(r"(?P<tenant>[^\s:]+)\s*:\s+(?P<key>\S+)")

_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagedserve_tenant", default=None)


# -- tenants and the cache salt -------------------------------------------------------------------
def own_tenant(key: str) -> str:
    """The tenant of a key its file names no tenant for: its own, named after its digest."""
    return OWN_TENANT_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The cache salt a request is hashed with: the client's salt inside its tenant's namespace.

    Without a tenant (no API keys configured) the client's salt as it is. With one, a digest
    of (tenant, client salt): two tenants never share a salt, whatever salts they send, and one
    tenant's requests without a salt share its cache as usual.
    """
    if tenant is None:
        return client_salt or None
    both = json.dumps([tenant, client_salt or ""], ensure_ascii=False)
    return "tenant:" + hashlib.sha256(both.encode()).hexdigest()


def request_tenant() -> str | None:
    """The tenant whose key authenticated the call being served (None when keys are off)."""
    return _tenant.get()


@contextlib.contextmanager
def authenticated_as(tenant: str) -> Iterator[None]:
    """Serve what runs inside (and the tasks it starts) as `tenant` (see `request_tenant`)."""
    token = _tenant.set(tenant)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # finalized in another context: that one ends anyway
            _tenant.reset(token)


def tenant_names(api_keys: Iterable[str], api_key_tenants: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """Every tenant a request can be served as: those of the keys (a named one, else the
    key's own), or DEFAULT_TENANT alone without keys. Bounded by the keys file: no client
    can add one (metrics label by these)."""
    named = dict(api_key_tenants)
    names = [named.get(key) or own_tenant(key) for key in api_keys]
    return tuple(dict.fromkeys(names)) or (DEFAULT_TENANT,)


def http_credentials(authorization: Sequence[str], x_api_key: Sequence[str]) -> list[str]:
    """Every credential of an HTTP request as Authorization values: its authorization headers
    and each `x-api-key` header (Anthropic's clients send the key there) as a Bearer value, so
    that exactly one credential, of either kind, is what authenticates."""
    return [*authorization, *(f"Bearer {key}" for key in x_api_key)]


def http_path_needs_key(path: str) -> bool:
    """With keys configured, whether an HTTP request for `path` must carry one."""
    return path not in PUBLIC_HTTP_PATHS


# -- keys files -----------------------------------------------------------------------------------
def _check_tenant(name: str, where: str) -> str:
    if not _TENANT_NAME.fullmatch(name) or name.startswith(OWN_TENANT_PREFIX):
        raise ValueError(
            f"api keys: {where}: tenant {name[:40]!r} must be 1-128 letters, digits, '.', '_', '@' or '-' "
            f"(starting with a letter or digit, not {OWN_TENANT_PREFIX!r})"
        )
    return name


def _check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key) or "#" in key:
        raise ValueError(f"api keys: {where}: a key is a non-empty string without spaces or '#'")
    return key


def _json_entries(
    data: Any, where: str, settings: list[tuple[str, TenantPolicy, str]]
) -> list[tuple[str, str | None]]:
    entries: list[tuple[str, str | None]] = []
    if isinstance(data, dict):  # {"tenant-a": ["key1", "key2"], "tenant-b": "key3"}
        for tenant, keys in data.items():
            if isinstance(keys, dict):  # {"tenant-a": {"keys": [...], "weight": 2}} (tenants.py)
                if tenant != EVERY_TENANT:
                    _check_tenant(tenant, where)
                listed, policy = json_settings(tenant, keys, where)
                settings.append((tenant, policy, f"{where}, tenant {tenant}"))
                if tenant == EVERY_TENANT:
                    if listed:
                        raise ValueError(f"api keys: {where}: {EVERY_TENANT!r} takes settings, not keys")
                    continue
            else:
                _check_tenant(tenant, where)
                listed = [keys] if isinstance(keys, str) else keys if isinstance(keys, list) else [None]
            entries += [(_check_key(key, f"{where}, tenant {tenant}"), tenant) for key in listed]
    elif isinstance(data, list):  # ["key1", {"key": "key2", "tenant": "tenant-a"}]
        for i, item in enumerate(data):
            if isinstance(item, dict):
                tenant = item.get("tenant")
                if tenant is not None:
                    _check_tenant(str(tenant), f"{where}[{i}]")
                entries.append((_check_key(item.get("key"), f"{where}[{i}]"), tenant))
            else:
                entries.append((_check_key(item, f"{where}[{i}]"), None))
    else:
        raise ValueError(f"api keys: {where}: JSON must be an object of tenant -> key(s) or a list of keys")
    return entries


def read_keys_file(path: str | Path) -> list[tuple[str, str | None]]:
    """(key, tenant or None) for every key in a keys file.

    Lines: `key` (a tenant of its own, the old format) or `tenant: key`; blank lines and `#`
    comments are ignored. Or JSON: `{"tenant-a": ["key1", "key2"], "tenant-b": "key3"}`, or a
    list of keys and `{"key": ..., "tenant": ...}` objects. Tenant settings lines and objects
    (controlplane/src/pagedserve/controlplane/tenancy/tenants.py) are read by `read_keys_and_settings`.
    """
    return read_keys_and_settings(path)[0]


def read_keys_and_settings(
    path: str | Path,
) -> tuple[list[tuple[str, str | None]], tuple[tuple[str, TenantPolicy], ...]]:
    """A keys file's keys (as `read_keys_file`) and its tenants' settings (tenants.py)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"api keys: no such file {path}")
    text = file.read_text()
    settings: list[tuple[str, TenantPolicy, str]] = []
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"api keys: {path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
        entries = _json_entries(data, str(path), settings)
        return entries, merge_settings(settings)
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        match = _TENANT_LINE.fullmatch(line)
        if match:
            entries.append((_check_key(match["key"], where), _check_tenant(match["tenant"], where)))
            continue
        tenant_settings = settings_line(line, where)
        if tenant_settings is not None:
            tenant, policy = tenant_settings
            if tenant != EVERY_TENANT:
                _check_tenant(tenant, where)
            settings.append((tenant, policy, where))
        else:
            entries.append((_check_key(line, where), None))
    return entries, merge_settings(settings)


def load_tenant_settings(key_file: str | Path | None) -> tuple[tuple[str, TenantPolicy], ...]:
    """The tenants' settings of a keys file (none without one); what ControlPlaneConfig's
    `tenant_settings` holds."""
    return () if key_file is None else read_keys_and_settings(key_file)[1]


def load_keys(
    keys: Iterable[str] = (), key_file: str | Path | None = None
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(every key, (key, tenant) for the keys with a named tenant) from flags plus a keys file;
    what ControlPlaneConfig's `api_keys` and `api_key_tenants` hold."""
    entries: list[tuple[str, str | None]] = [(k.strip(), None) for k in keys if k.strip()]
    if key_file is not None:
        entries += read_keys_file(key_file)
    tenants: dict[str, str] = {}
    for key, tenant in entries:
        if tenant is None:
            continue
        if tenants.setdefault(key, tenant) != tenant:
            raise ValueError(f"api keys: one key is listed for two tenants ({tenants[key]} and {tenant})")
    ordered = tuple(dict.fromkeys(key for key, _ in entries))
    return ordered, tuple((key, tenants[key]) for key in ordered if key in tenants)


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None) -> tuple[str, ...]:
    """Every key from flags plus a file (in order, without repeats)."""
    return load_keys(keys, key_file)[0]


# -- checking -------------------------------------------------------------------------------------
class ApiKeys:
    """Checks bearer tokens in constant time against the SHA-256 of each configured key and
    says whose they are."""

    def __init__(
        self, keys: Iterable[str], tenants: Mapping[str, str] | Iterable[tuple[str, str]] = ()
    ) -> None:
        named = dict(tenants)
        self._entries = [(hashlib.sha256(k.encode()).digest(), named.get(k) or own_tenant(k)) for k in keys]
        if not self._entries:
            raise ValueError("api keys: at least one key is needed to enable authentication")

    def authenticate(self, values: Sequence[str]) -> str | None:
        """The tenant of the key in `values`, every Authorization header of one call; None when
        there is none, more than one, or the key is unknown."""
        if len(values) != 1:
            return None
        scheme, _, token = values[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        # Compare against every key (no early exit) so timing reveals nothing.
        tenant = None
        for key_digest, key_tenant in self._entries:
            if hmac.compare_digest(digest, key_digest):
                tenant = key_tenant
        return tenant

    def check_header(self, value: str | None) -> bool:
        """Whether one Authorization header `value` carries a known key."""
        return self.authenticate([] if value is None else [value]) is not None


def refusal_message(values: Sequence[str]) -> str:
    """Why a call with these Authorization headers is refused."""
    return DUPLICATE_AUTHORIZATION_MESSAGE if len(values) > 1 else UNAUTHENTICATED_MESSAGE


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects GenerationService calls without exactly one valid key with UNAUTHENTICATED, and
    serves the others as the key's tenant (`request_tenant()` inside the handler)."""

    def __init__(self, keys: ApiKeys, on_reject: Callable[[], None] | None = None) -> None:
        self.keys = keys
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_GRPC_PREFIX):
            return handler
        values = metadata_values(handler_call_details.invocation_metadata, "authorization")
        tenant = self.keys.authenticate(values)
        if tenant is None:
            if self.on_reject is not None:
                self.on_reject()
            return deny_like(handler, grpc.StatusCode.UNAUTHENTICATED, refusal_message(values))
        return _as_tenant(handler, tenant)


def _as_tenant(handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour run as `tenant`."""
    serializers = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def call_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with authenticated_as(tenant):
                return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(call_unary, *serializers)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        async def call_unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with authenticated_as(tenant):
                responses = unary_stream(request, context)
                if not inspect.isasyncgen(responses):
                    await responses  # a handler that writes with context.write()
                    return
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(call_unary_stream, *serializers)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def call_stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            with authenticated_as(tenant):
                return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(call_stream_unary, *serializers)
    stream_stream = handler.stream_stream

    async def call_stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        with authenticated_as(tenant):
            responses = stream_stream(requests, context)
            if not inspect.isasyncgen(responses):
                await responses
                return
            async for response in responses:
                yield response

    return grpc.stream_stream_rpc_method_handler(call_stream_stream, *serializers)
