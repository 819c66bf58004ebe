"""Per-tenant limits: requests in progress and a token rate, refused with a retry hint.

`TenantLimits.acquire` is called once per request before it queues; it returns a `Lease`
that `release` must end whatever happens to the request (finished, cancelled, failed,
refused later): the tenant's concurrency slot comes back then, and so do the tokens the
request was charged for but did not generate. A refusal is RESOURCE_EXHAUSTED (HTTP 429)
with a retry-after hint, the same shape as a full admission queue's, and is counted per
tenant and reason for the metrics. Tenants and their policies come from the keys file
(controlplane/src/pagedserve/controlplane/tenancy/tenants.py); a tenant without limits costs one dictionary look-up.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.tenancy.tenants import TenantPolicy

CONCURRENCY = "max_concurrency"
TOKEN_RATE = "tokens_per_minute"


@dataclass
class Lease:
    """One request's hold on its tenant's limits."""

    tenant: str
    charged: int  # tokens taken at the start: prompt + max_tokens × n
    prompt_tokens: int
    started: float
    generated: int = 0  # tokens streamed so far (every sample)
    admitted: bool = False  # it left the admission queue for a data plane
    released: bool = False

    @property
    def unused(self) -> int:
        """Tokens charged but not generated (the refund at the end): all of them for a
        request refused or ended before any data plane took it."""
        if not self.admitted:
            return self.charged
        return max(0, self.charged - self.prompt_tokens - self.generated)


class _Bucket:
    """A token bucket holding one minute's worth, refilled continuously."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, tokens: int) -> float:
        """Seconds until `tokens` may be taken (0: now). A request larger than the bucket
        may go when the bucket is full, leaving it in debt: it is never refused forever."""
        need = min(float(tokens), self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate


class TenantLimits:
    def __init__(
        self, policies: Mapping[str, TenantPolicy], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policies = dict(policies)
        self._clock = clock
        now = clock()
        self._buckets = {
            t: _Bucket(p.tokens_per_minute, now) for t, p in self.policies.items() if p.tokens_per_minute
        }
        self.in_progress: Counter[str] = Counter()  # tenant -> requests holding a lease
        self.refused: Counter[tuple[str, str]] = Counter()  # (tenant, limit) -> refusals
        self._mean_s: dict[str, float] = {}  # tenant -> EWMA of its requests' durations

    def acquire(self, tenant: str, prompt_tokens: int, charged: int) -> Lease:
        """A lease for a request of `tenant` that may take `charged` tokens (prompt + max_tokens
        × n); RESOURCE_EXHAUSTED with a retry hint when a limit of the tenant is reached."""
        now = self._clock()
        policy = self.policies.get(tenant)
        if policy is not None and policy.max_concurrency is not None:
            running = self.in_progress[tenant]
            if running >= policy.max_concurrency:
                # About when one of them ends: the tenant's typical request duration.
                hint = max(1.0, round(self._mean_s.get(tenant, 1.0), 1))
                self.refused[(tenant, CONCURRENCY)] += 1
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"tenant {tenant} has {running} requests in progress, its limit "
                    f"({CONCURRENCY} {policy.max_concurrency}); retry in ~{hint:g}s",
                    retry_after_s=hint,
                )
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.refill(now)
            wait = bucket.wait_s(charged)
            if wait > 0:
                hint = max(1.0, round(wait, 1))
                self.refused[(tenant, TOKEN_RATE)] += 1
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"tenant {tenant} is over its token rate ({TOKEN_RATE} {bucket.capacity:g}): this "
                    f"request counts {charged} tokens (prompt + max_tokens × n); retry in ~{hint:g}s",
                    retry_after_s=hint,
                )
            bucket.level -= charged
        self.in_progress[tenant] += 1
        return Lease(tenant, charged, prompt_tokens, now)

    def release(self, lease: Lease) -> None:
        """The request ended (any way): its slot and its unused tokens come back. Idempotent."""
        if lease.released:
            return
        lease.released = True
        self.in_progress[lease.tenant] -= 1
        if self.in_progress[lease.tenant] <= 0:
            del self.in_progress[lease.tenant]
        now = self._clock()
        bucket = self._buckets.get(lease.tenant)
        if bucket is not None:
            bucket.refill(now)
            bucket.level = min(bucket.capacity, bucket.level + lease.unused)
        mean = self._mean_s.get(lease.tenant)
        took = now - lease.started
        self._mean_s[lease.tenant] = took if mean is None else 0.8 * mean + 0.2 * took
