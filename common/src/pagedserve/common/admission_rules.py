"""When a request can never run on a data plane: the one rule both planes apply. No torch.

The control plane applies it per data plane before admitting a request, the scheduler when the
request is submitted, so a client gets the same answer whichever layer sees the request first
(and the control plane never queues a request its data planes would refuse). `beyond_context`
is the API edge's stricter rule for a max_tokens the client set (vLLM's 400).
"""

from __future__ import annotations

from pagedserve.common.block_hash import cdiv


def max_total_tokens(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens a request can ever hold: prompt plus max_tokens, capped at max_model_len."""
    return min(prompt_tokens + max_tokens, max_model_len)


def prompt_too_long(prompt_tokens: int, max_model_len: int, prompt_only: bool = False) -> str | None:
    """Why a prompt can never run in a context of `max_model_len`, or None if it can.
    `prompt_only` (a pooling request): it generates nothing, so it may fill the context."""
    if prompt_only and prompt_tokens > max_model_len:
        return f"prompt has {prompt_tokens} tokens, but max_model_len is {max_model_len}"
    if not prompt_only and prompt_tokens >= max_model_len:
        return (
            f"prompt has {prompt_tokens} tokens, but max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one generated token)"
        )
    return None


def beyond_context(
    prompt_tokens: int, max_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> str | None:
    """Why an explicit max_tokens (named `field` as the client named it) does not fit the
    context after the prompt, or None if it does. The API edge refuses such a request as vLLM
    does, rather than let it run to the end of the context; the engine itself (offline API,
    scheduler) caps a sequence at max_model_len instead.
    """
    if prompt_tokens < max_model_len and prompt_tokens + max_tokens > max_model_len:
        return (
            f"{field} is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens})"
        )
    return None


def refusal(
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    *,
    prompt_only: bool = False,
) -> str | None:
    """Why a request can never run on a data plane with these limits, or None if it can.

    Per sample: a request's samples each hold their own blocks and a data plane runs them one
    after another when its pool is short, so more samples only ever wait longer.
    """
    too_long = prompt_too_long(prompt_tokens, max_model_len, prompt_only)
    if too_long is not None:
        return too_long
    total = prompt_tokens if prompt_only else max_total_tokens(prompt_tokens, max_tokens, max_model_len)
    need = cdiv(total, block_size)
    if need > num_blocks:
        return (
            f"prompt plus max_tokens needs {need} KV blocks but the whole pool has only {num_blocks}; "
            "lower max_tokens or shorten the prompt"
        )
    return None
