"""Control-plane configuration: frozen dataclasses, one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.common.env import MODEL_HOME_HELP
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.common.settings import check_bounds, setting
from pagedserve.common.tls import ClientTLS, ServerTLS, read_token_file
from pagedserve.controlplane.reasoning import REASONING_PARSERS
from pagedserve.controlplane.tenancy.tenants import TenantPolicy, check_settings
from pagedserve.controlplane.tools.definitions import DEFAULT_MAX_TOOL_CALLS, MAX_TOOL_CALLS_LIMIT
from pagedserve.controlplane.tools.prompt import PARSER_CHOICES


@dataclass(frozen=True)
class RoutingWeights:
    """Knobs of the routing score (see docs/routing.md).

    score(d) = prefix_weight · cached_prompt_fraction(d)
             − usage_weight · budget_used_fraction_after(d)
             − load_weight · max(running + waiting, in_flight)(d) / max_num_seqs(d)
    """

    prefix_weight: float = setting(
        1.0, "routing: weight of the cached prompt fraction", flag="--routing-prefix-weight", minimum=0
    )
    usage_weight: float = setting(
        0.5, "routing: weight of KV budget use", flag="--routing-usage-weight", minimum=0
    )
    load_weight: float = setting(
        0.5, "routing: weight of queue length", flag="--routing-load-weight", minimum=0
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class ControlPlaneConfig:
    """`dataplanes` are host:port addresses; `dataplane_dns` (host:port) is re-resolved every
    `dns_refresh_s` and every address it yields joins the set (the Helm headless Service); an
    address that leaves it takes no new requests and keeps its link until its streams end (at
    most `dataplane_drain_timeout_s`), then the link closes.

    Admission: at most `max_queue_len` requests wait for KV budget, each at most
    `queue_timeout_s` (or its deadline, if sooner). A request reserves the blocks its
    prompt needs (minus those the chosen data plane already caches) plus
    `decode_reserve_blocks` for its first generated tokens.

    Deadline: the soonest of the call's gRPC deadline, the HTTP body's `timeout` and
    `request_timeout_s`; the data plane drops a request past it (controlplane/src/pagedserve/controlplane/deadlines.py).

    Shutdown (SIGTERM/SIGINT): health turns NOT_SERVING, new requests are refused UNAVAILABLE,
    and running ones have `shutdown_grace_s` to finish before the process exits.
    """

    model: str = setting(DEFAULT_MODEL, "model name or folder (for its tokenizer)")
    model_home: str | None = setting(None, MODEL_HOME_HELP)
    dataplanes: tuple[str, ...] = setting(
        (),
        "a data plane HOST:PORT, repeatable (default: none; give --dataplane or --dataplane-dns)",
        flag="--dataplane",
        repeat=True,
    )
    dataplane_dns: str | None = setting(
        None, "discover data planes by DNS: NAME:PORT (default: none, only the --dataplane addresses)"
    )
    dns_refresh_s: float = setting(10.0, "seconds between DNS lookups", cli=False)
    dataplane_drain_timeout_s: float = setting(
        300.0,
        "seconds a data plane that left DNS may finish its streams before its link is closed",
        flag="--dataplane-drain-timeout",
        minimum=0,
    )
    shutdown_grace_s: float = setting(
        30.0,
        "on SIGTERM: seconds running streams may take to finish (new requests are refused)",
        flag="--shutdown-grace",
        minimum=0,
    )
    http_header_timeout_s: float = setting(
        10.0,
        "seconds an HTTP client has to send a request's head before its connection is closed (slowloris)",
        flag="--http-header-timeout",
        exclusive_minimum=0,
    )
    http_max_connections_per_client: int = setting(
        256,
        "HTTP connections one client address may hold open at once; one more is closed as soon "
        "as it is accepted (0: no cap; behind a proxy every client shares the proxy's address)",
        minimum=0,
    )
    dataplane_wait_s: float = setting(
        90.0,
        "start-up: seconds a request that arrives before any data plane has connected waits for "
        "one (it then runs; past this, or its deadline, it fails UNAVAILABLE); 0: fail at once",
        flag="--dataplane-wait",
        minimum=0,
        maximum=3600,
    )
    max_queue_len: int = setting(1024, "requests that may wait for KV budget", minimum=0)
    queue_timeout_s: float = setting(
        60.0, "seconds a request may wait for KV budget", flag="--queue-timeout", exclusive_minimum=0
    )
    request_timeout_s: float | None = setting(
        None,
        "seconds a request may take in all, queue included, before it ends with DEADLINE_EXCEEDED "
        "(HTTP 504) and the data plane drops it, freeing its blocks (default: none; a gRPC deadline "
        "or an HTTP body's `timeout` that is sooner applies instead)",
        flag="--request-timeout",
        exclusive_minimum=0,
    )
    decode_reserve_blocks: int = setting(1, "blocks reserved per sample beyond the prompt", minimum=0)
    tenant_dispatch_tokens: int = setting(
        4096,
        "with two or more tenants: a data plane is sent a new request only while this replica's "
        "requests there that still wait for their first token reserve fewer KV tokens than this "
        "(about two steps of prefill: one running, one queued) and do not outnumber its free batch slots; the rest wait "
        "here, where tenants take turns (0: no cap, the data plane's first-come-first-served "
        "queue holds them)",
        minimum=0,
    )
    routing: RoutingWeights = field(default_factory=RoutingWeights)
    reconnect_backoff_s: float = setting(0.2, "first reconnect delay to a lost data plane", cli=False)
    reconnect_backoff_max_s: float = setting(2.0, "longest reconnect delay", cli=False)
    served_model_names: tuple[str, ...] = setting(
        (),
        "model names clients may use, repeatable; the first is reported (default: the --model name; "
        "for a local folder or .gguf file its name, the path as given also accepted)",
        flag="--served-model-name",
    )
    tool_call_parser: str = setting(
        "auto",
        "the format the model writes tool calls in (auto: read from its chat template; "
        "hermes when the template names none)",
        choices=PARSER_CHOICES,
    )
    max_tool_calls: int = setting(
        DEFAULT_MAX_TOOL_CALLS,
        'the most calls a forced tool_choice "required" answer may hold when parallel_tool_calls is '
        'true (the grammar ends the answer there; its choice then has stop_reason "max_tool_calls")',
        minimum=1,
        maximum=MAX_TOOL_CALLS_LIMIT,
    )
    reasoning_parser: str = setting(
        "none",
        "split a reasoning model's <think>...</think> section out of chat answers as "
        "reasoning_content (and reasoning), in messages and stream deltas (none: leave it in the content)",
        choices=REASONING_PARSERS,
    )
    # The Responses API's store (controlplane/src/pagedserve/controlplane/responses/store.py): in memory, per tenant.
    responses_store_max_entries: int = setting(
        1024,
        "Responses API: responses kept (those created with store: true) for previous_response_id, "
        "GET and DELETE; the least recently used go first (0: no store, store and "
        "previous_response_id are refused)",
        minimum=0,
    )
    responses_store_max_bytes: int = setting(
        64 << 20,
        "Responses API: bytes the stored responses may hold in all (their JSON and bookkeeping)",
        minimum=1,
    )
    responses_store_ttl_s: float = setting(
        3600.0,
        "Responses API: seconds a stored response is kept",
        flag="--responses-store-ttl",
        exclusive_minimum=0,
    )
    dataplane_token_file: str | None = setting(
        None,
        "send the data planes the shared token in this file (their --dataplane-token-file) "
        "(default: none, no token)",
    )
    # Security settings come from files (controlplane/src/pagedserve/controlplane/cli.py reads them): not flags of their own.
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # (key, tenant) for the keys a keys file names a tenant for; every other key is a tenant
    # of its own. A tenant is part of its requests' cache salt (controlplane/src/pagedserve/controlplane/tenancy/auth.py).
    api_key_tenants: tuple[tuple[str, str], ...] = ()
    # (tenant or "*", policy): weights and limits from the keys file (controlplane/src/pagedserve/controlplane/tenancy/tenants.py).
    tenant_settings: tuple[tuple[str, TenantPolicy], ...] = ()
    tls: ServerTLS | None = None  # the public gRPC and HTTP ports
    dataplane_tls: ClientTLS | None = None  # the links to the data planes (mTLS with a client cert)

    def __post_init__(self) -> None:
        if not self.dataplanes and not self.dataplane_dns:
            raise ValueError(
                "dataplanes: give at least one --dataplane HOST:PORT or --dataplane-dns NAME:PORT"
            )
        for address in (*self.dataplanes, *([self.dataplane_dns] if self.dataplane_dns else [])):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dataplane address must be HOST:PORT, got {address!r}")
        check_bounds(self)
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}, got {self.tool_call_parser!r}"
            )
        unknown = sorted({key for key, _ in self.api_key_tenants} - set(self.api_keys))
        if unknown:
            raise ValueError(f"api_key_tenants: {len(unknown)} key(s) not in api_keys")
        check_settings(self.tenant_settings, self.api_key_tenants)
        if self.dataplane_token_file is not None:
            read_token_file(self.dataplane_token_file)  # a missing or empty file fails at start-up

    @property
    def dataplane_token(self) -> str | None:
        """The shared token the links send to the data planes (read from its file), or None."""
        return None if self.dataplane_token_file is None else read_token_file(self.dataplane_token_file)


def model_names(
    model: str, served_model_names: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the names a server lists and reports, the names it also accepts) for `model` (a store
    name, a local folder or a .gguf file). `served_model_names` win; a local folder is served
    under its folder's name (a GGUF file under its name less `.gguf`) and its path as given is
    still accepted, so clients need not know where the model lies on the server."""
    if served_model_names:
        return served_model_names, ()
    path = Path(model)
    name = path.stem if path.suffix == ".gguf" else path.name
    if not name or name == model:
        return (model,), ()
    return (name,), (model,)
