"""`GET /v1/responses/{id}/input_items` driven by the official `openai` client
(`responses.input_items.list`) against a real server (tiny random-weight model): a stored
response lists its own request's input (not the conversation it continued), as items with ids,
newest first by default, in pages (`limit`, `after`, `order`); another API key's response is
404; bad query parameters are 400 naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.agents_api.conftest import KEY, OTHER_KEY
from tests.e2e.harness import ServerThread


def client_for(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_input_items_of_a_stored_response(server: ServerThread, model: Path) -> None:
    client = client_for(server, KEY)
    first = client.responses.create(model=str(model), input="Say hello.", max_output_tokens=2, store=True)
    (only,) = client.responses.input_items.list(first.id).data
    assert only.type == "message" and only.role == "user" and only.id.startswith("msg_")  # type: ignore[union-attr]
    assert [c.text for c in only.content] == ["Say hello."]  # type: ignore[union-attr]
    items: Any = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "One."}]},
        {"role": "assistant", "content": "Two."},
        {"id": "msg_mine", "role": "user", "content": "Three?"},
    ]
    second = client.responses.create(
        model=str(model), input=items, previous_response_id=first.id, max_output_tokens=2, store=True
    )
    listed = client.responses.input_items.list(second.id)
    texts = [item.content[0].text for item in listed.data]  # type: ignore[union-attr]
    assert texts == ["Three?", "Two.", "One.", "Be brief."]  # newest first; its own input only
    assert listed.data[0].id == "msg_mine" and listed.data[1].content[0].type == "output_text"  # type: ignore[union-attr]
    ascending = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.content[0].text for item in ascending.data] == ["Be brief.", "One."]  # type: ignore[union-attr]
    assert ascending.has_more and ascending.last_id == ascending.data[-1].id
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=ascending.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["Two.", "Three?"]  # type: ignore[union-attr]
    assert not rest.has_more
    # The client's auto-pagination walks every page.
    walked = [item.id for item in client.responses.input_items.list(second.id, limit=1)]
    assert walked == [item.id for item in listed.data]
    with pytest.raises(openai.NotFoundError):
        client_for(server, OTHER_KEY).responses.input_items.list(second.id)
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.input_items.list(second.id, **query)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param  # type: ignore[index]
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(second.id)
