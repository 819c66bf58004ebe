"""Speculative decoding over the OpenAI API (the default model, a real server): a reply that
copies its prompt reports its accepted and rejected drafted tokens in OpenAI's
`completion_tokens_details`; `speculative: false` drafts nothing and reports none; the text
is the same either way (greedy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from pagedserve.dataplane.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.e2e.harness import ServerThread

PASSAGE = (
    "Farmers from three villages brought their grain to the mill after the harvest, and the "
    "miller kept a careful ledger of every sack that passed through his door."
)


@pytest.fixture(scope="module")
def client(default_model_path: Path) -> Iterator[OpenAI]:
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path), num_threads=1),
        cache=CacheConfig(num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(
            max_model_len=1024,
            speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
        ),
    )
    server = ServerThread(config, default_model_path)
    try:
        yield OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0)
    finally:
        server.close()


def test_usage_counts_accepted_and_rejected_drafts(client: OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}
    ]
    drafted = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=40,
        temperature=0,
    )
    plain = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.usage is not None and plain.usage is not None
    details = drafted.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens is not None
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens is not None and details.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details is None
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens


def test_a_non_boolean_opt_out_is_refused_naming_the_field(client: OpenAI) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"speculative": "no"},
        )
    assert "speculative" in str(err.value)
