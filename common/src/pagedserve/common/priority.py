"""A request's scheduling priority: vLLM's field, its bounds and its check. No torch.

Lower values are scheduled earlier (vLLM's semantics); 0 is the default, and negative values
are allowed. Both planes apply the same check: the control plane on the public APIs (gRPC
`GenerateRequest.priority`, the HTTP body's `priority`), the data plane on
`SubmitCommand.priority`, so an out-of-range value is refused with a message naming the field
whichever plane sees it first. The bounds leave the scheduler's aging arithmetic far from any
overflow and are wider than any priority scheme a client would use.
"""

from __future__ import annotations

PRIORITY_FIELD = "priority"
MIN_PRIORITY = -1_000_000
MAX_PRIORITY = 1_000_000


def priority_refusal(value: object, field_name: str = PRIORITY_FIELD) -> str | None:
    """Why `value` is not a priority (an integer in [MIN_PRIORITY, MAX_PRIORITY]), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{field_name} must be an integer, got {value!r}"
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        return f"{field_name} must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value}"
    return None
