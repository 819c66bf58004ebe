"""A request's tenant and weight on the link between the planes: their bounds and check. No torch.

The control plane names each request's tenant (its API key's, from the keys file) and the
tenant's weight when it serves two or more tenants; the data plane's scheduler then shares its
batch between the tenants present by weight (dataplane/src/pagedserve/dataplane/scheduler/fair_share.py). An empty
tenant is one anonymous tenant, and a weight of 0 on the wire means the default, 1: a data
plane fed by a control plane that sends neither schedules exactly as before. Both bounds match
the keys file's (tenant names of at most 128 characters, weights in (0, 1e6]), so every tenant
a control plane can name passes, and the data plane refuses anything else INVALID_ARGUMENT.
"""

from __future__ import annotations

import math

TENANT_FIELD = "tenant"
TENANT_WEIGHT_FIELD = "tenant_weight"
MAX_TENANT_LEN = 128
MAX_TENANT_WEIGHT = 1e6
DEFAULT_TENANT_WEIGHT = 1.0


def tenant_refusal(tenant: str, weight: float) -> str | None:
    """Why (`tenant`, `weight`) as sent on the link cannot be scheduled, or None."""
    if len(tenant) > MAX_TENANT_LEN:
        return f"{TENANT_FIELD} must be at most {MAX_TENANT_LEN} characters, got {len(tenant)}"
    if not (math.isfinite(weight) and 0 <= weight <= MAX_TENANT_WEIGHT):
        return (
            f"{TENANT_WEIGHT_FIELD} must be in (0, {MAX_TENANT_WEIGHT:g}] (0: the default, 1), got {weight!r}"
        )
    return None


def wire_weight(weight: float) -> float:
    """The weight a checked wire value stands for: 0 (unset) is the default."""
    return weight if weight > 0 else DEFAULT_TENANT_WEIGHT
