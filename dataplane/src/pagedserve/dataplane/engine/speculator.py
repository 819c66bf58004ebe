"""The engine's side of speculative decoding: before a step, drafts for the sequences that
decode (`propose`); after it, what was accepted (`verified`). Imports no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pagedserve.dataplane.request import Request
from pagedserve.dataplane.scheduler.output import SchedulerOutput
from pagedserve.dataplane.scheduler.step_budget import decodes_next
from pagedserve.dataplane.speculative.config import SpeculativeConfig
from pagedserve.dataplane.speculative.drafter import Drafter
from pagedserve.dataplane.speculative.ngram import NgramDrafter
from pagedserve.dataplane.speculative.policy import Acceptance, StepCost, draft_lengths, worth_drafting
from pagedserve.dataplane.speculative.suffix import SuffixDrafter

# One step in this many that could draft verifies at least the first draft of each request.
PROBE_EVERY = 32


@dataclass
class SpeculationStats:
    """Cumulative counts: drafted tokens verified, those accepted, and drafted runs verified
    (each run also yields one token of its own, so tokens per run = 1 + accepted / runs)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    runs: int = 0


def make_drafter(config: SpeculativeConfig) -> Drafter:
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixDrafter(
        config.prompt_lookup_max * 4,
        config.suffix_min_probability,
        config.suffix_cache_requests,
    )


def drafts_allowed(request: Request) -> bool:
    """Whether a decoding request may draft: not with sampling that reads the output history
    (penalties, min_tokens, bad words: each drafted row would need the history up to it) or
    masks every row alike (allowed_token_ids), nor when it opted out. With a grammar it drafts
    what the grammar allows (`propose`), each drafted row masked by the state it reaches."""
    p = request.sampling_params
    return request.first_chunk_end is None and not p.has_penalties and not p.has_masks and p.speculative


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter if drafter is not None else make_drafter(config)
        self.acceptance = Acceptance()
        self.cost = StepCost()
        self.stats = SpeculationStats()
        self._drafting_steps = 0

    def propose(self, running: Sequence[Request], room: Callable[[Request], int]) -> None:
        """Set each running request's `spec_token_ids` for the next step: drafts for those
        that decode and may draft, cut to what pays (policy.py) and to `room(request)`, the
        tokens it may still append; none for the others."""
        eligible: list[tuple[Request, int]] = []
        for request in running:
            request.spec_token_ids = []
            if decodes_next(request):
                k = min(self.config.num_speculative_tokens, room(request) - 1)
                eligible.append((request, k if k > 0 and drafts_allowed(request) else 0))
        if not any(k for _, k in eligible):
            return
        cost = self.cost.line()
        self._drafting_steps += 1
        probe = cost is None or self._drafting_steps % PROBE_EVERY == 1
        if not self.config.adaptive:
            cost, probe = None, False
        rates = {r.request_id: self.acceptance.rate(r.request_id) for r, k in eligible if k}
        if not probe and not worth_drafting(max(rates.values()), len(eligible), cost):
            return  # not even the likeliest first draft would pay: spare the drafter's work
        proposals = self._drafts(eligible)
        counts = {rid: len(d) for rid, d in proposals.items()}
        lengths = counts if not self.config.adaptive else dict.fromkeys(proposals, 0)
        if cost is not None:
            lengths = draft_lengths(counts, rates, len(eligible), cost)
        if probe:
            # Now and then each request verifies at least its first draft, whatever the policy
            # says: acceptance and the cost's slope are measured only on steps that draft, and
            # a policy that stopped would never see them change (a request starts repeating
            # itself, the batch shrinks). One token each keeps the probe cheap at any batch.
            lengths = {rid: max(n, 1) for rid, n in lengths.items()}
        by_id = {r.request_id: r for r in running}
        for rid, draft in proposals.items():
            by_id[rid].spec_token_ids = draft[: lengths[rid]]

    def _drafts(self, eligible: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Each eligible request's draft of up to k tokens (none for k = 0), cut where its
        grammar, if it has one, would refuse it."""
        proposals: dict[str, list[int]] = {}
        for request, k in eligible:
            draft = self.drafter.propose(request.request_id, request.all_token_ids, k) if k else []
            if draft and request.grammar is not None:
                draft = draft[: request.grammar.valid_prefix(draft)]
            if draft:
                proposals[request.request_id] = draft
        return proposals

    def verified(
        self, out: SchedulerOutput, accepted: Mapping[str, Sequence[int]], seconds: float | None
    ) -> None:
        """After a step: learn each drafted run's acceptance, and the step's cost from its
        `seconds` (None for a step that computed prompt tokens: another cost)."""
        for item in out.scheduled:
            rid = item.request.request_id
            drafted = len(item.spec_token_ids)
            if not drafted:
                self.acceptance.idle(rid)
                continue
            n = len(accepted.get(rid, ()))
            self.acceptance.verified(rid, drafted, n)
            item.request.num_spec_drafted += drafted
            item.request.num_spec_accepted += n
            self.stats.drafted_tokens += drafted
            self.stats.accepted_tokens += n
            self.stats.runs += 1
        if seconds is not None:
            self.cost.observe(out.num_batched_tokens, seconds)

    def finished(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.acceptance.forget(request.request_id)
            self.drafter.finished(request.request_id, request.all_token_ids, request.num_prompt_tokens)
