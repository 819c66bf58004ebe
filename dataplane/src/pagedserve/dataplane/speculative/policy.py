"""How many drafted tokens are worth verifying this step. Imports no torch.

A step's time grows with the tokens it computes: about `fixed + per_token * tokens`, the
fixed part being mostly the weights read once (`StepCost` fits both from the steps the
engine times). A drafted token at position j of a sequence whose drafts are accepted at rate
a (per position, `Acceptance`) yields a**j expected tokens. Drafts are taken, best yield
first, while each raises the step's expected tokens per second, i.e. while
yield / per_token > expected tokens / expected step time. At one stream the fixed part
dominates and drafts with a small chance still pay; at a large batch the step is compute-bound
and only drafts that are nearly certain do: drafting turns itself down as the batch grows, and
a request whose drafts keep failing stops drafting until its rate recovers.
"""

from __future__ import annotations

# Until the fit has seen steps of different sizes, a token is assumed to cost this share of
# the fixed part of a step (a CPU decode step of a few streams is bound by reading weights).
PRIOR_TOKEN_SHARE = 1 / 8
# Weights of a new observation in the running fits: about the last 50 steps / 5 drafts count.
COST_DECAY = 0.98
ACCEPTANCE_WEIGHT = 0.2
# A request not drafting drifts back towards the acceptance of all requests, so it tries again.
RECOVERY = 0.05
INITIAL_ACCEPTANCE = 0.6
# A draft must pay this many times its fitted cost: the line misses part of what drafting
# costs (proposing, the extra logits and sampling rows, the probes), and a draft that only
# breaks even is not worth the risk of a slower batch.
MARGIN = 1.5


class StepCost:
    """A least-squares line through (tokens, seconds) of recent steps, older ones decayed."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0.0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step was seen."""
        if self._w == 0.0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.25:  # steps of different sizes: the slope is measured
            slope = (self._xy / self._w - mx * my) / var
            fixed = my - slope * mx
            if slope > 0.0 and fixed > 0.0:
                return fixed, slope
        fixed = my / (1.0 + PRIOR_TOKEN_SHARE * mx)
        return fixed, PRIOR_TOKEN_SHARE * fixed


class Acceptance:
    """Per request, the rate at which its drafted positions are accepted (a running mean over
    positions verified), starting from the mean of all requests."""

    def __init__(self) -> None:
        self.overall = INITIAL_ACCEPTANCE
        self._rates: dict[str, float] = {}

    def rate(self, request_id: str) -> float:
        return self._rates.get(request_id, self.overall)

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` positions were accepted (a prefix: then one rejection)."""
        rate = self.rate(request_id)
        for hit in [1.0] * accepted + [0.0] * (1 if accepted < drafted else 0):
            rate += ACCEPTANCE_WEIGHT * (hit - rate)
            self.overall += ACCEPTANCE_WEIGHT / 8 * (hit - self.overall)
        self._rates[request_id] = rate

    def idle(self, request_id: str) -> None:
        """A step in which the request drafted nothing: drift back towards the overall rate."""
        rate = self._rates.get(request_id)
        if rate is not None:
            self._rates[request_id] = rate + RECOVERY * (self.overall - rate)

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)


def draft_lengths(
    proposals: dict[str, int], rates: dict[str, float], decoding: int, cost: tuple[float, float]
) -> dict[str, int]:
    """How many of each request's proposed drafts to verify: `proposals` maps a request to its
    drafts' count, `rates` to its acceptance rate; `decoding` sequences decode this step;
    `cost` is (fixed seconds, seconds per token)."""
    fixed, per_token = cost
    candidates = sorted(
        ((rates[rid] ** j, j, rid) for rid, n in proposals.items() for j in range(1, n + 1)),
        key=lambda c: (-c[0], c[1]),
    )
    taken = dict.fromkeys(proposals, 0)
    tokens, rows = float(decoding), float(decoding)
    for gain, j, rid in candidates:
        if taken[rid] != j - 1:
            continue  # (only after the drafts before it in its sequence)
        if gain * (fixed + per_token * rows) <= MARGIN * per_token * tokens:
            break  # every later candidate yields less, and the bar only rises
        taken[rid] = j
        tokens += gain
        rows += 1
    return taken


def worth_drafting(best_rate: float, decoding: int, cost: tuple[float, float] | None) -> bool:
    """Whether a first draft accepted at `best_rate` (the best of the batch) would raise a
    step's expected tokens per second with `decoding` sequences decoding: when not, no draft
    of this step would (`draft_lengths` takes none), and proposing them is wasted work."""
    if cost is None:
        return True
    fixed, per_token = cost
    return best_rate * (fixed + per_token * decoding) > MARGIN * per_token * decoding
