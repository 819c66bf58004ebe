"""Tenants' shares and limits, as the API keys file sets them.

A tenant (controlplane/src/pagedserve/controlplane/tenancy/auth.py) may be given, in the same keys file as its keys:

- `weight` (default 1): its share of admission when tenants compete for KV blocks; the
  admission queue serves equal-priority requests in weighted fair order of tokens
  (controlplane/src/pagedserve/controlplane/routing/admission.py);
- `max_concurrency` (default none): requests of the tenant in progress at once (queued for
  budget or generating); one more is refused RESOURCE_EXHAUSTED / 429 with a retry hint;
- `tokens_per_minute` (default none): a token bucket holding one minute's worth, refilled
  continuously; a request takes its prompt + max_tokens × n tokens when it starts and gets
  back what it did not generate when it ends; a request finding too few is refused the same
  way, with the seconds until the bucket has them as its hint.

Lines format: `tenant-a weight=2 max_concurrency=8 tokens_per_minute=60000` (a tenant's
name, then settings; `*` for every tenant without a line of its own). JSON: a tenant's value
may be an object, `{"tenant-a": {"keys": ["k1"], "weight": 2}, "*": {"max_concurrency": 4}}`.
Such lines and objects were errors before, so every keys file that loaded still loads the same.
Without API keys every request is one tenant, DEFAULT_TENANT.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.common.tenant_share import MAX_TENANT_WEIGHT

DEFAULT_TENANT = "default"  # every request when API keys are off
EVERY_TENANT = "*"  # the settings line for tenants without one of their own
SETTINGS = ("weight", "max_concurrency", "tokens_per_minute")
MAX_WEIGHT = MAX_TENANT_WEIGHT  # (the data plane checks the same bound on the link)
_INT = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0
    max_concurrency: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # None: no limit

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, int | float) and 0 < self.weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be a number in (0, {MAX_WEIGHT:g}], got {self.weight!r}")
        for name in ("max_concurrency", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _value(name: str, raw: object) -> float | int:
    """A setting's value from a line's text or a JSON value."""
    if name == "weight":
        if isinstance(raw, str):
            try:
                number = float(raw)
            except ValueError:
                raise ValueError(f"weight must be a number, got {raw[:20]!r}") from None
        elif isinstance(raw, int | float) and not isinstance(raw, bool):
            number = float(raw)
        else:
            raise ValueError(f"weight must be a number, got {type(raw).__name__}")
        if not math.isfinite(number):
            raise ValueError(f"weight must be finite, got {raw!r}")
        return number
    if isinstance(raw, str):
        if not _INT.fullmatch(raw):
            raise ValueError(f"{name} must be a whole number >= 1, got {raw[:20]!r}")
        return int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{name} must be a whole number >= 1, got {type(raw).__name__}")
    return raw


def policy_from(settings: Mapping[str, object], where: str) -> TenantPolicy:
    """The policy the named settings give; ValueError naming `where` and the setting."""
    values: dict[str, Any] = {}
    for name, raw in settings.items():
        if name not in SETTINGS:
            raise ValueError(
                f"api keys: {where}: unknown tenant setting {name[:40]!r} (known: {', '.join(SETTINGS)})"
            )
        try:
            values[name] = _value(name, raw)
            TenantPolicy(**{name: values[name]})
        except ValueError as exc:
            raise ValueError(f"api keys: {where}: {exc}") from None
    return TenantPolicy(**values)


def settings_line(line: str, where: str) -> tuple[str, TenantPolicy] | None:
    """(tenant, policy) for a settings line, or None when `line` is not one (a key line).

    A settings line is a name and at least one `setting=value`, separated by spaces; a key
    line never has spaces but for `tenant: key`, so nothing that was a key line is one."""
    words = line.split()
    if len(words) < 2 or words[0].endswith(":") or not all("=" in w for w in words[1:]):
        return None
    settings: dict[str, str] = {}
    for word in words[1:]:
        name, _, value = word.partition("=")
        if name in settings:
            raise ValueError(f"api keys: {where}: {name} given twice")
        settings[name] = value
    return words[0], policy_from(settings, where)


def json_settings(tenant: str, value: Mapping[str, Any], where: str) -> tuple[list[Any], TenantPolicy]:
    """A JSON tenant object's keys (a list) and policy: `{"keys": [...], "weight": 2, ...}`."""
    keys = value.get("keys", [])
    listed = [keys] if isinstance(keys, str) else keys if isinstance(keys, list) else [None]
    rest = {name: v for name, v in value.items() if name != "keys"}
    return listed, policy_from(rest, f"{where}, tenant {tenant}")


def merge_settings(found: Iterable[tuple[str, TenantPolicy, str]]) -> tuple[tuple[str, TenantPolicy], ...]:
    """One policy per tenant from (tenant, policy, where) in file order; a tenant given two
    settings lines is an error naming both places."""
    seen: dict[str, tuple[TenantPolicy, str]] = {}
    for tenant, policy, where in found:
        if tenant in seen:
            raise ValueError(
                f"api keys: {where}: settings for tenant {tenant} already given at {seen[tenant][1]}"
            )
        seen[tenant] = (policy, where)
    return tuple((tenant, policy) for tenant, (policy, _) in seen.items())


def check_settings(
    settings: Iterable[tuple[str, TenantPolicy]], api_key_tenants: Iterable[tuple[str, str]]
) -> None:
    """Settings name only tenants the keys name (a typo in a name would silently not apply)."""
    named = {tenant for _, tenant in api_key_tenants}
    for tenant, _ in settings:
        if tenant != EVERY_TENANT and tenant not in named:
            raise ValueError(
                f"api keys: settings for tenant {tenant[:40]!r}, which no key belongs to "
                f"(name it in a `{tenant[:40]}: KEY` line, or use {EVERY_TENANT!r} for every tenant)"
            )


def policies(names: Iterable[str], settings: Iterable[tuple[str, TenantPolicy]]) -> dict[str, TenantPolicy]:
    """Each tenant's policy: its own line, else the `*` line, else the defaults."""
    given = dict(settings)
    fallback = given.get(EVERY_TENANT, TenantPolicy())
    return {name: given.get(name, fallback) for name in names}
