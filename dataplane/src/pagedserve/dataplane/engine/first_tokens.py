"""The first tokens of an n > 1 request's other samples, drawn from its primary's logits row.

The samples of one prompt would each compute that prompt again and sample their first token
from the same row; instead they draw it from the primary's row, in the primary's step and the
next ones, a bounded number per step (docs/operations.md, "Heavy requests"). A sample that
ends with its first token never computes anything; one that goes on joins the batch, computes
its prompt as one chunk, then decodes that token (`Request.first_chunk_end`), the steps it took
before, so its later tokens are unchanged.
"""

from __future__ import annotations

import torch

from pagedserve.common.log import get_logger
from pagedserve.dataplane.runner.model_runner import ModelRunner
from pagedserve.dataplane.runner.sampler import SampledToken
from pagedserve.dataplane.scheduler import Request, Scheduler, SchedulerOutput

log = get_logger(__name__)

FIRST_TOKEN_DRAW_ELEMENTS = 1 << 18
"""Per step, the most vocabulary entries that the first-token draws of n > 1 requests' samples
sweep (each draw sweeps the whole vocabulary with the sample's own generator: ~1.2 ms at
49,152 entries on the 2-core test machine): 5 draws a step for the default model, about a
quarter of a decode step there. The samples past it draw in the next steps from their
primary's logits row, kept, so one request's n draws are spread over steps rather than held
against every stream's next token. (10 a step let a guard stream's longest gap reach 3.0 /
3.4 / 4.1x its median under an n = 128 request; 5: 2.6 / 3.2 / 2.7x, the request taking
0.81 s instead of 0.49 s.)"""


class FirstTokenDraws:
    """The kept rows and the per-step draws. `pending` is the engine's own map of each primary
    to its samples still waiting to join (shared, not copied)."""

    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, pending: dict[str, list[Request]], vocab_size: int
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pending = pending
        self.vocab_size = vocab_size
        # A primary's logits row, kept while its samples draw their first tokens from it.
        self.rows: dict[str, torch.Tensor] = {}

    def plan(self, out: SchedulerOutput) -> tuple[dict[str, list[Request]], int]:
        """The step's riders (`riders`) and the draws left for the kept rows: older requests'
        samples first, then the riders, within the per-step bound."""
        draws = max(1, FIRST_TOKEN_DRAW_ELEMENTS // self.vocab_size)
        older = sum(len(self.undrawn(rid)) for rid in self.rows)
        riders = self.riders(out, max(0, draws - older))
        return riders, draws - sum(len(r) for r in riders.values())

    def riders(self, out: SchedulerOutput, draws: int) -> dict[str, list[Request]]:
        """The samples waiting for a primary that samples its first token this step: up to
        `draws` of them draw their first tokens from its logits row in the same step (the row
        they would compute themselves later: same prompt, no output yet, same bias and
        penalties; the sampler shares its work over the vocabulary); the row is kept for the
        others, who draw from it in the next steps (`draw`). A structured-output request's
        samples wait as before (their masks are per sample)."""
        riders: dict[str, list[Request]] = {}
        for item in out.scheduled:
            primary = item.request
            siblings = self.pending.get(primary.request_id)
            if siblings and item.samples and not primary.num_output_tokens and primary.grammar is None:
                riders[primary.request_id] = [s for s in siblings if not s.status.finished][: max(0, draws)]
                draws -= len(riders[primary.request_id])
        return riders

    def keep(self, riders: dict[str, list[Request]]) -> None:
        """After the riders' step: keep each primary's row while samples are left to draw."""
        for rid in riders:
            row = self.runner.kept_rows.pop(rid, None)
            if row is not None and self.undrawn(rid):
                self.rows[rid] = row

    def undrawn(self, rid: str) -> list[Request]:
        """The samples of request `rid` still to draw their first token from its kept row."""
        return [s for s in self.pending.get(rid, []) if not s.status.finished and not s.num_output_tokens]

    def draw(self, draws: int) -> tuple[dict[str, SampledToken], list[Request]]:
        """Up to `draws` first tokens from the kept rows, oldest request first, without a
        forward; returns the tokens and the samples they finished. A row whose draw raises is
        dropped: its samples then compute their prompt and sample as any request does."""
        sampled: dict[str, SampledToken] = {}
        finished: list[Request] = []
        for rid, row in list(self.rows.items()):
            undrawn = self.undrawn(rid)
            take = undrawn[: max(0, draws)]
            if len(take) == len(undrawn):
                del self.rows[rid]
            if not take:
                continue
            try:
                tokens = self.runner.draw(row, take)
            except Exception as exc:
                log.warning("first_token_draw_failed", request_id=rid, error=repr(exc)[:500])
                self.rows.pop(rid, None)
                continue
            sampled.update(tokens)
            finished.extend(self.take({rid: take}, tokens))
            draws -= len(take)
        return sampled, finished

    def take(self, riders: dict[str, list[Request]], sampled: dict[str, SampledToken]) -> list[Request]:
        """Each rider's first token, as the scheduler would take it: appended, its logprobs
        kept, its stop checked. One that ends with it (max_tokens 1, EOS, a stop token) is
        finished without computing anything; the others join later as before, and compute
        their prompt before decoding the token (`Request.first_chunk_end`). Returns those
        that finished."""
        finished: list[Request] = []
        for siblings in riders.values():
            for sibling in siblings:
                token = sampled.get(sibling.request_id)
                if token is None or sibling.status.finished:
                    continue  # the step was rerun without riders (a fault): it samples later
                if token.logprob is not None:
                    sibling.output_logprobs.append(token.logprob)
                    if token.top_logprobs is not None:
                        sibling.output_top_logprobs.append(token.top_logprobs)
                sibling.append_output_token(token.token_id)
                reason = self.scheduler.stop_reason(sibling, token.token_id)
                if reason is None:
                    sibling.first_chunk_end = sibling.num_prompt_tokens
                else:
                    sibling.status = reason
                    finished.append(sibling)
        return finished
