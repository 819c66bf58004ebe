"""When a request stops: after each token appended, the scheduler asks why it should end. No torch."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.dataplane.request import Request, RequestStatus


def stop_reason(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Why `request` ends with `token` just appended, or None if it goes on."""
    params = request.sampling_params
    if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and (not request.grammar.accept(token) or request.grammar.terminated):
        # Complete (a stop token accepted), or a token the mask should have excluded (only
        # possible if every token was masked): either way nothing valid can follow.
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(request: Request, run: Sequence[int], max_model_len: int) -> RequestStatus | None:
    """Append a step's tokens (one, or an accepted drafted run and its own token) to
    `request`, up to the first that ends it; why it ends, if one does."""
    for token in run:
        request.append_output_token(token)
        reason = stop_reason(request, token, max_model_len)
        if reason is not None:
            return reason
    return None
