"""How many prompt tokens a step may compute while other requests decode. Imports no torch.

Every decoding stream's next token waits for the whole step, so a step that also prefills a
burst of prompts (a control plane's streams reconnecting, many calls at once) stretches every
running stream's inter-token gap. Two bounds keep such a step short, and the scheduler takes
the smaller:

- a fixed count of prompt tokens (`max_prefill_tokens_while_decoding`), and
- `MixedStepBudget`: as many prompt tokens as stretch the step by at most `stretch`
  decode-only steps, from the step times the engine measures as it runs. A fixed count is
  right for one model on one CPU only: the same 32 tokens take 10 ms on one machine and 100 on
  another, and a decode step of a few streams is 20 ms on one and 200 on another. The ratio is
  what a running stream feels, so the budget holds the ratio on every machine.

The cost of this is the newcomers' time to first token: a prompt of L tokens then prefills
over about L / budget steps of 1 + `stretch` decode steps each, about (1 + stretch) / stretch
times its prefill alone (Sarathi-Serve, OSDI 2024, makes the same trade with a fixed token budget).

A request whose effective priority is better than every decoding request's is not held back
for them (`urgent_prompt_tokens`): its prompt is computed whole, as it would be with nothing
running.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.dataplane.request import Request
from pagedserve.dataplane.scheduler.output import SchedulerOutput
from pagedserve.dataplane.scheduler.priority import Priorities

# Steps with fewer prompt tokens than this say too little about a prompt token's cost (their
# time is mostly the decode and the step's fixed overhead): they are not sampled.
MIN_PROMPT_SAMPLE = 8
# Weight of a new step time in the running means: about the last 10 steps count.
SMOOTHING = 0.2
# The budget never goes below this, so a prompt always advances by a useful chunk.
MIN_PROMPT_TOKENS = 8


def decodes_next(request: Request) -> bool:
    """Whether `request` computes one token of its output next, not a chunk of its prompt (or
    of a recomputed context)."""
    left = request.compute_end - request.num_computed_tokens
    return left == 1 and request.num_computed_tokens >= request.num_prompt_tokens


def split_tokens(out: SchedulerOutput) -> tuple[int, int]:
    """(prompt tokens, decode tokens) a scheduled step computes; read before its output is
    applied (the requests' progress then moves on)."""
    prompt = decode = 0
    for item in out.scheduled:
        if decodes_next(item.request):
            decode += item.num_new_tokens
        else:
            prompt += item.num_new_tokens
    return prompt, decode


class MixedStepBudget:
    """Learns a decode-only step's time and a prompt token's marginal cost from measured steps
    (`observe`) and answers how many prompt tokens stretch a step that also decodes by at
    most `stretch` decode-only steps (`tokens`; None until both have been measured)."""

    def __init__(self, stretch: float, *, smoothing: float = SMOOTHING) -> None:
        if not stretch > 0.0:
            raise ValueError(f"the prefill stretch must be above 0, got {stretch}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.stretch = stretch
        self.smoothing = smoothing
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None

    def observe(self, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step that computed `prompt_tokens` and `decode_tokens` took `seconds`."""
        if seconds <= 0.0:
            return
        if prompt_tokens == 0:
            if decode_tokens > 0:
                self.decode_step_s = self._mean(self.decode_step_s, seconds)
            return
        if prompt_tokens < MIN_PROMPT_SAMPLE:
            return
        base = self.decode_step_s if decode_tokens > 0 and self.decode_step_s is not None else 0.0
        # A prompt-only step counts its fixed overhead as prompt work (a smaller budget, the safe
        # side); a noisy mixed step no longer than a decode step still counts a tenth of itself.
        marginal = max(seconds - base, 0.1 * seconds)
        self.prompt_token_s = self._mean(self.prompt_token_s, marginal / prompt_tokens)

    def tokens(self) -> int | None:
        if self.decode_step_s is None or self.prompt_token_s is None:
            return None
        spare = self.stretch * self.decode_step_s
        return max(MIN_PROMPT_TOKENS, int(spare / self.prompt_token_s))

    def _mean(self, mean: float | None, sample: float) -> float:
        return sample if mean is None else mean + self.smoothing * (sample - mean)


def urgent_prompt_tokens(
    queues: Iterable[Iterable[Request]], running: list[Request], ranks: Priorities
) -> int:
    """Prompt tokens still to compute of the requests whose effective priority is strictly
    better than every decoding request's (0 when nothing decodes: then nothing is bounded)."""
    decoding = [ranks.effective(r) for r in running if decodes_next(r)]
    if not decoding:
        return 0
    best = min(decoding)
    return sum(
        r.compute_end - r.num_computed_tokens
        for queue in queues
        for r in queue
        if not decodes_next(r) and ranks.effective(r) < best
    )
