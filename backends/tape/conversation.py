"""A conversation as the model's own template sees it, with the documented fallbacks.

The volatile part of a session can be the whole conversation after the stable
prefix (``SuffixInput.messages``): user turns, the assistant's replies and tool
calls, tool results. It is rendered with the model's chat template, so tool
calls and tool results reach the model in the format it was trained on.

Templates differ in what they can express. Each template is checked once per
engine (cached per template digest): does its source handle ``tool_calls`` and
the ``tool`` role, and does a made-up call and result then show up in the
prompt it renders? The source matters because an engine may paper over a
template that knows no tools — openvino-genai's minja injects its own JSON
format for calls and results — which would make the two engines send the same
conversation differently, and in a format the model was never trained on. Where
a template cannot express a turn, it is rendered as text the model can still
read, never dropped:

* an assistant tool call becomes assistant text in the Hermes format the output
  parser reads: ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``;
* a tool result becomes a user turn labelled with the tool and the call it
  answers: ``<tool_response name="…" id="…">\\n…\\n</tool_response>``.

An assistant turn with tool calls and no text is rendered with ``content: ""``
(templates that concatenate ``message['content']`` fail on ``None``), and call
arguments that are a JSON object are passed to the template as an object, the
shape HF templates expect (``tool_call.arguments | tojson``).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from contract.types import ChatMessage, ToolCall

from .model import ChatTemplate
from .toolformats import FORMATS, ToolFormat, template_call_id

__all__ = ["TemplateAbilities", "abilities", "template_messages", "tool_call_text", "tool_result_text"]

_TOOL_CALLS_IN_SOURCE = re.compile(r"\btool_calls\b")
_TOOL_ROLE_IN_SOURCE = re.compile(r"""['"]tool['"]""")
_PROBE_NAME = "modeld_probe_function"
_PROBE_RESULT = "modeld_probe_result_text"
_PROBE_ID = "probecall"  # nine letters: Mistral's templates refuse any other call id


@dataclass(frozen=True)
class TemplateAbilities:
    """What a chat template renders itself (the rest goes through the text fallbacks)."""

    tool_calls: bool
    tool_results: bool
    #: the template concatenates a call's arguments as text (DeepSeek V3.1) rather than ``tojson``-ing an object
    string_arguments: bool = False


_cache: dict[tuple[str, str], TemplateAbilities] = {}
_lock = threading.Lock()


def _renders(template: ChatTemplate, messages: list[dict[str, Any]], needle: str) -> bool:
    try:
        return needle in template.render(messages, None, generation=True)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe gets the fallback
        return False


def abilities(template: ChatTemplate) -> TemplateAbilities:
    """Probe ``template`` once per engine and digest: which tool turns it renders itself."""
    key = (type(template).__name__, template.digest)
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    system = {"role": "system", "content": "probe"}
    user = {"role": "user", "content": "probe question"}
    call = {"id": _PROBE_ID, "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
    source = template.source
    calls = bool(_TOOL_CALLS_IN_SOURCE.search(source))
    as_object = calls and _renders(
        template, [system, user, {"role": "assistant", "content": "", "tool_calls": [call]}], _PROBE_NAME)
    as_text = False
    if calls and not as_object:
        call = {**call, "function": {"name": _PROBE_NAME, "arguments": "{}"}}
        as_text = _renders(template, [system, user, {"role": "assistant", "content": "", "tool_calls": [call]}],
                           _PROBE_NAME)
    found = TemplateAbilities(
        tool_calls=as_object or as_text,
        string_arguments=as_text,
        tool_results=bool(_TOOL_ROLE_IN_SOURCE.search(source))
        and _renders(
            template,
            [
                system,
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": _PROBE_ID, "name": _PROBE_NAME},
            ],
            _PROBE_RESULT,
        ),
    )
    with _lock:
        _cache[key] = found
    return found


def _arguments(raw: str) -> Any:
    """Call arguments as the template expects them: a JSON object as an object, anything else as given."""
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def tool_call_text(call: ToolCall) -> str:
    """A tool call as assistant text (Hermes format: what ``backends.tape.output`` parses back)."""
    body = json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tool_result_text(msg: ChatMessage) -> str:
    """A tool result as labelled user text."""
    name = json.dumps(msg.name, ensure_ascii=False)
    call_id = json.dumps(msg.tool_call_id, ensure_ascii=False)
    return f"<tool_response name={name} id={call_id}>\n{msg.content or ''}\n</tool_response>"


def template_messages(
    template: ChatTemplate, system: str, messages: list[ChatMessage], fmt: ToolFormat = FORMATS["hermes"]
) -> list[dict[str, Any]]:
    """The system turn and ``messages`` as the dicts ``template.render`` takes (call ids in the form ``fmt``'s
    templates accept)."""
    can = abilities(template)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for msg in messages:
        if msg.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
            if msg.reasoning:
                turn["reasoning_content"] = msg.reasoning
                turn["thinking"] = msg.reasoning  # the name gpt-oss's template reads
            if msg.tool_calls and can.tool_calls:
                turn["tool_calls"] = [
                    {
                        "id": template_call_id(call.id, fmt),
                        "type": call.type or "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": call.function.arguments if can.string_arguments
                            else _arguments(call.function.arguments),
                        },
                    }
                    for call in msg.tool_calls
                ]
            elif msg.tool_calls:
                texts = [turn["content"]] if turn["content"] else []
                turn["content"] = "\n".join(texts + [tool_call_text(call) for call in msg.tool_calls])
            out.append(turn)
        elif msg.role == "tool":
            if can.tool_results:
                out.append({"role": "tool", "content": msg.content or "", "name": msg.name,
                            "tool_call_id": template_call_id(msg.tool_call_id, fmt)})
            else:
                out.append({"role": "user", "content": tool_result_text(msg)})
        else:
            out.append({"role": msg.role, "content": msg.content or ""})
    return out
