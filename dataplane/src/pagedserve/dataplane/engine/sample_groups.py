"""n > 1 at the engine's edge: one request's samples as a group of requests.

`add_request` with `n` / `best_of` > 1 makes one request per sample. The first (the primary)
is scheduled at once; the others (siblings) wait until the primary has computed the prompt,
then join and reuse its cached full prompt blocks through the prefix cache (ref counts rise).
While they wait, their first tokens are drawn from the primary's logits row
(first_tokens.py), a bounded number per step. The step sees the group only through
`plan` (before the forward) and `collect` (after it).
"""

from __future__ import annotations

import time

from pagedserve.dataplane.engine.first_tokens import FirstTokenDraws
from pagedserve.dataplane.runner.model_runner import ModelRunner
from pagedserve.dataplane.runner.sampler import SampledToken
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

Riders = dict[str, list[Request]]


class SampleGroups:
    """Every request's samples until `release`, and the siblings still waiting to join."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, vocab_size: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.samples: dict[str, list[Request]] = {}
        # Siblings of a primary waiting until it has computed the prompt (shared with the draws).
        self.pending: dict[str, list[Request]] = {}
        self.first_tokens = FirstTokenDraws(runner, scheduler, self.pending, vocab_size)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.samples

    def add(self, samples: list[Request]) -> None:
        """Schedule the primary (`samples[0]`); the others wait for it."""
        primary = samples[0]
        self.scheduler.add_request(primary)
        if len(samples) > 1:
            self.pending[primary.request_id] = samples[1:]
        self.samples[primary.request_id] = samples

    def plan(self, out: SchedulerOutput) -> tuple[Riders, int]:
        """Before the forward: the siblings that draw their first token from their primary's
        row in this step (riders), and the draws left for the kept rows."""
        return self.first_tokens.plan(out)

    def collect(
        self, riders: Riders, sampled: dict[str, SampledToken], draws: int
    ) -> tuple[dict[str, SampledToken], list[Request]]:
        """After the forward: the riders' first tokens taken, the kept rows' draws made and the
        siblings whose primary has computed its prompt admitted; returns the drawn tokens
        (beyond `sampled`) and the samples they finished."""
        drawn: dict[str, SampledToken] = {}
        finished: list[Request] = []
        if riders:
            finished.extend(self.first_tokens.take(riders, sampled))
            self.first_tokens.keep(riders)
        if self.first_tokens.rows and draws > 0:
            drawn, done = self.first_tokens.draw(draws)
            finished.extend(done)
        self.admit()
        return drawn, finished

    def admit(self) -> None:
        """Siblings join once their primary has a token (or ended); those still to draw from
        its kept row wait for it."""
        for rid, siblings in list(self.pending.items()):
            primary = self.samples[rid][0]
            if primary.num_output_tokens or primary.status.finished:
                rows = self.first_tokens.rows
                waiting = self.first_tokens.undrawn(rid) if rid in rows else []
                if waiting:
                    self.pending[rid] = waiting
                else:
                    del self.pending[rid]
                for sibling in (s for s in siblings if s not in waiting):
                    if not sibling.status.finished:  # a first token ended it (FirstTokenDraws.take)
                        self.scheduler.add_request(sibling)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def samples_of(self, request_id: str) -> list[Request]:
        return list(self.samples.get(request_id, []))

    def release(self, request_id: str) -> None:
        self.samples.pop(request_id, None)

    def primary_of(self, engine_id: str) -> str:
        """The request id a sample belongs to (samples of n > 1 share their primary's group)."""
        for rid, samples in self.samples.items():
            if any(r.request_id == engine_id for r in samples):
                return rid
        return engine_id

    def abort(self, request_id: str) -> Request | None:
        """Abort every sample of a request, freeing their blocks; the primary, or None."""
        samples = self.samples.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.first_tokens.rows.pop(request_id, None)
        if samples is None:
            return None
        for r in samples:
            if self.scheduler.abort(r.request_id) is None and not r.status.finished:
                r.status = RequestStatus.FINISHED_ABORTED  # a sibling that never joined
            self.runner.release(r.request_id)
        return samples[0]

    def abort_sample(self, request_id: str, index: int) -> Request | None:
        """Abort sample `index` of a request (LLMEngine.abort_sample)."""
        samples = self.samples.get(request_id)
        if samples is None or not 0 <= index < len(samples) or samples[index].status.finished:
            return None
        sample = samples[index]
        if self.scheduler.abort(sample.request_id) is None:  # a sibling that never joined
            pending = self.pending.get(request_id, [])
            self.pending[request_id] = [s for s in pending if s is not sample]
            sample.status = RequestStatus.FINISHED_ABORTED
        self.runner.release(sample.request_id)
        sample.finish_time = time.monotonic()
        # Siblings wait for the primary's first token, or its end: aborting it must let them
        # join now (a step with nothing scheduled would never admit them).
        self.admit()
        return sample
