"""Tools into the prompt: through the model's own chat template when it knows tools, else by a
system message in the Hermes format (which the default parser then reads back).

A template "knows tools" when it reads the `tools` variable (transformers passes the request's
tools to the template as `tools`, in OpenAI's JSON shape, and so do we). For such templates the
conversation goes in as OpenAI has it: an assistant message's `tool_calls` (their arguments
parsed into objects, as templates index them) and `tool` messages with their `tool_call_id`.
A template that does not read `tools` (SmolLM2's, for one) would drop them silently; for it the
tools are described in the system message, earlier calls are written back as `<tool_call>`
blocks and tool results as `<tool_response>` blocks in a user message — the format Hermes-style
models are trained on (NousResearch's Hermes function-calling prompt; Qwen2.5 uses it too).

Which output parser reads the answer (`--tool-call-parser auto`) follows the same evidence:
markers the template itself writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.controlplane.tools.definitions import ToolUse

PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral")
"""`--tool-call-parser` values: auto picks from the chat template."""
_READS_TOOLS = re.compile(r"\btools\b")


def template_reads_tools(template: str | None) -> bool:
    return template is not None and _READS_TOOLS.search(template) is not None


def resolve_parser(setting: str, template: str | None) -> str:
    """The output format of the model's tool calls: the setting, or for "auto" the format the
    template's own markers name (Hermes when it names none: the fallback prompt teaches it)."""
    if setting != "auto":
        return setting
    if template is None or not template_reads_tools(template):
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return "hermes"


def template_inputs(
    messages: Sequence[Mapping[str, Any]], use: ToolUse, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render the template with: tools None when the template gets none."""
    tools = [t.as_template_tool() for t in use.tools] if use.choice.calls_tools else []
    if template_reads_tools(template):
        return [_with_parsed_arguments(m) for m in messages], tools or None
    return _hermes_messages(messages, tools), None


def _with_parsed_arguments(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
            for call in calls
        ]
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as templates index them: the parsed object (its text when it is not
    JSON, as the model may have written it)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def hermes_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. The functions are described "
        "as JSON Schemas inside <tools></tools> tags:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, answer with one JSON object per call inside <tool_call></tool_call> "
        "tags, holding the function's name and its arguments:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def _hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = message.get("tool_calls") or []
        if calls:
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in calls
            ]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        instructions = hermes_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
