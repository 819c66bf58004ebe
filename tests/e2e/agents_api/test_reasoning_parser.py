"""`--reasoning-parser` end to end (tiny random-weight model, deepseek_r1's parser): a chat
answer forced by a regex to `<think>…</think>…` comes back split into `reasoning_content`
(and `reasoning`) and `content`, streamed deltas assembling to the message; an unconstrained
greedy answer is split exactly as the parser splits the same answer served without a parser,
on the chat route, as Anthropic thinking blocks (`messages.create`, `messages.stream`) and as
Responses reasoning items (`responses.create`, `responses.stream`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pagedserve.controlplane.reasoning import ChoiceReasoning
from tests.e2e.agents_api.conftest import CONTEXT
from tests.e2e.harness import ServerThread, engine_config

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
FORCED = {"guided_regex": "<think>[a-c]{3}</think>[x-z]{2}"}
GREEDY: Any = {"temperature": 0}


@pytest.fixture(scope="module")
def thinking(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        engine_config(model, num_blocks=256, max_model_len=CONTEXT), model, reasoning_parser="deepseek_r1"
    )
    yield srv
    srv.close()


def chat_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="alpha", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_text(server: ServerThread, model: Path) -> str:
    """The greedy answer served without a reasoning parser (the package's server)."""
    out = chat_client(server).chat.completions.create(
        model=str(model),
        messages=QUESTION,
        max_tokens=10,
        temperature=0,
    )
    return out.choices[0].message.content or ""


def test_a_think_section_is_split_out_of_messages_and_deltas(thinking: ServerThread, model: Path) -> None:
    client = chat_client(thinking)
    kwargs: Any = {
        "model": str(model),
        "messages": QUESTION,
        "max_tokens": 32,
        "temperature": 0,
        "extra_body": FORCED,
    }
    message = client.chat.completions.create(**kwargs).choices[0].message
    extra = message.model_extra or {}
    assert (
        re.fullmatch("[a-c]{3}", extra["reasoning_content"])
        and extra["reasoning"] == extra["reasoning_content"]
    )
    assert re.fullmatch("[x-z]{2}", message.content or "")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_extra or {}
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (extra["reasoning_content"], message.content)


def test_every_api_splits_the_greedy_answer_as_the_parser_splits_it(
    thinking: ServerThread, model: Path, plain_text: str
) -> None:
    reasoning, content = ChoiceReasoning("deepseek_r1").split(plain_text)
    assert reasoning  # (a random model never closes the section: all of it is reasoning)
    chat = chat_client(thinking).chat.completions.create(
        model=str(model),
        messages=QUESTION,
        max_tokens=10,
        temperature=0,
    )
    assert (chat.choices[0].message.model_extra or {})["reasoning_content"] == reasoning
    assert chat.choices[0].message.content == content

    claude = anthropic.Anthropic(base_url=thinking.http_url, api_key="x", max_retries=0, timeout=120)
    kwargs: Any = {"model": str(model), "max_tokens": 10, "messages": QUESTION, "extra_body": GREEDY}
    out = claude.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert (out.content[0].thinking, out.content[1].text) == (reasoning, content)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content]

    responses = chat_client(thinking).responses
    response = responses.create(model=str(model), input="Say hello.", max_output_tokens=10, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning  # type: ignore[union-attr,index]
    assert response.output_text == content
    with responses.stream(
        model=str(model), input="Say hello.", max_output_tokens=10, temperature=0
    ) as events:
        kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
