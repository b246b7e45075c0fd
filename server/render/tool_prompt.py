"""Tools for a chat template that cannot show them: the tools described in the system message,
and earlier calls and their results written into the conversation in the generic format
(`server/api/generic_tools.py`), so any template renders them as plain messages."""

from __future__ import annotations

import json
from typing import Any

from hotlora.server.api.generic_tools import CALLS_KEY, GenericToolCalls

RESULTS_KEY = "tool_results"


def generic_messages(
    messages: list[dict[str, Any]],
    tool_calls: GenericToolCalls | None,
    *,
    system_role: bool = True,
) -> list[dict[str, Any]]:
    """`messages` (as `template_message` writes them) for a template that cannot show tools:
    an assistant message's calls become its JSON text, a run of `tool` messages one user
    message holding their results, and the tools (when the answer may call them) are described
    in the system message, or at the head of the first user message when the template has no
    `system` role."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, from the calls seen so far
    for message in messages:
        if message.get("tool_calls"):
            out.append(_assistant_calls(message, names))
        elif message["role"] == "tool":
            result = _result(message, names)
            previous = out[-1] if out else None
            if previous is not None and previous.get(RESULTS_KEY) is not None:
                previous[RESULTS_KEY].append(result)
            else:
                out.append({"role": "user", RESULTS_KEY: [result]})
        else:
            out.append(dict(message))
    for message in out:
        results = message.pop(RESULTS_KEY, None)
        if results is not None:
            message["content"] = _json({RESULTS_KEY: results})
    if tool_calls is not None:
        _describe(out, tool_description(tool_calls), system_role)
    return out


def takes_system_messages(tokenizer: Any) -> bool:
    """Whether the chat template renders a system message (some refuse one, or any role but
    user and assistant)."""
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - any refusal, by `raise_exception` or a failed render
        return False
    return True


def tool_description(tool_calls: GenericToolCalls) -> str:
    """What the system message says of the tools and of how to call them."""
    listed = [
        {
            key: tool["function"][key]
            for key in ("name", "description", "parameters")
            if key in tool["function"]
        }
        for tool in tool_calls.tools
    ]
    lines = [
        "You can call tools. Each is listed as JSON: its name, what it does and the JSON schema "
        "of its arguments.",
        *(_json(tool) for tool in listed),
        "",
        "To call tools, answer with a JSON object and nothing else, in this form:",
        _json({CALLS_KEY: [{"name": "<tool name>", "arguments": {"<name>": "<value>"}}]}),
    ]
    if tool_calls.use == "auto":
        lines.append("To answer without calling a tool, write the answer as plain text.")
    elif tool_calls.use == "required":
        lines.append("You must call a tool now.")
    else:
        lines.append(f"You must call the tool {json.dumps(tool_calls.use)} now.")
    if tool_calls.parallel:
        lines.append("To make several calls at once, list them all.")
    else:
        lines.append("Make one call at a time.")
    lines.append(
        "The results come back in a user message, as "
        + _json({RESULTS_KEY: [{"name": "<tool name>", "content": "<result>"}]})
        + "."
    )
    return "\n".join(lines)


def _assistant_calls(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call["function"]
        names[call["id"]] = function["name"]
        calls.append({"name": function["name"], "arguments": function["arguments"]})
    text = message.get("content") or ""
    written = _json({CALLS_KEY: calls})
    out = {key: value for key, value in message.items() if key != "tool_calls"}
    out["content"] = f"{text}\n{written}" if text.strip() else written
    return out


def _result(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    name = message.get("name") or names.get(message.get("tool_call_id") or "")
    result: dict[str, Any] = {"name": name} if name else {}
    result["content"] = message.get("content") or ""
    return result


def _describe(messages: list[dict[str, Any]], description: str, system_role: bool) -> None:
    """Add `description` to the system message, made first if there is none."""
    head = messages[0] if messages else None
    if head is not None and head["role"] in ("system", "developer"):
        head["content"] = f"{head.get('content') or ''}\n\n{description}".lstrip()
    elif system_role:
        messages.insert(0, {"role": "system", "content": description})
    else:
        for message in messages:
            if message["role"] == "user":
                message["content"] = f"{description}\n\n{message.get('content') or ''}"
                break


def _json(value: Any) -> str:
    """JSON as the generic format writes it: the grammar's separators, text unescaped."""
    return json.dumps(value, ensure_ascii=False)
