"""Chat messages (tool calls and tool results included) to chat-template input.

Templates that reference ``tools`` get OpenAI-shaped messages (arguments decoded to dicts, tool
messages carrying ``tool_call_id`` and the function ``name``) plus the ``tools=`` list. Templates
without tool support get the default format, which needs nothing but system/user/assistant
messages with string content:

* the tool definitions and calling instructions are appended to the first system message (or a
  new system message is put first); none are shown in mode "none";
* an assistant turn's calls are written into its content as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (no separator) on a line after
  any text;
* tool results (roles "tool" and legacy "function") become user messages holding
  ``<tool_response>\\n...\\n</tool_response>`` blocks, consecutive results merged into one.

Also for plain requests: "developer" becomes "system", text content parts are joined with
newlines, and any other content part is rejected (400, ``param`` = ``messages[i].content``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.errors import bad_request
from server.protocol import ChatMessage
from server.tools.format import CALL_SEPARATOR, format_call, format_response
from server.tools.plan import ToolPlan
from server.tools.prompt import tools_system_prompt

Msg = dict[str, Any]
_TOOLS_RE = re.compile(r"\btools\b")
_MEDIA_PARTS = frozenset({"image_url", "image", "input_image", "input_audio", "audio", "audio_url", "video",
                          "video_url", "file", "input_file"})


def template_supports_tools(tokenizer: Any, chat_template: str | None) -> bool:
    """Whether the chat template in use (``chat_template`` if given, else the tokenizer's)
    refers to ``tools``."""
    source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = "\n".join(str(v) for v in source.values())
    elif isinstance(source, list):
        source = "\n".join(str(item.get("template", "")) for item in source if isinstance(item, dict))
    return bool(source) and bool(_TOOLS_RE.search(source))


@dataclass(frozen=True)
class ImageSlots:
    """How a vision-language model's template gets the images of user messages: as
    ``{"type": "image"}`` parts between text parts (``placeholder`` None: the template renders
    them), or as ``placeholder`` text written where each image was."""

    placeholder: str | None = None


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, template_supports_tools: bool,
    images: ImageSlots | None = None,
) -> tuple[list[Msg], list[Msg] | None]:
    """Template-ready message dicts and the ``tools`` argument for ``apply_chat_template``
    (None when not passed). ``images``: where image parts go (None: the model is text-only and an
    image part is a 400). Raises ``APIError`` 400 for malformed messages."""
    calls = _CallNames()
    normalized = [_normalize(i, m, calls, images) for i, m in enumerate(messages)]
    if template_supports_tools:
        tools = [t.to_openai() for t in plan.tools] if plan and plan.mode != "none" else None
        return [_openai_shape(m) for m in normalized], tools
    write_call = _call_writer(plan)
    rendered = _merge_results([_default_shape(m, write_call) for m in normalized])
    if plan is not None and plan.mode != "none":
        rendered = _with_system(rendered, tools_system_prompt(plan, None if write_call is format_call else write_call))
    return rendered, None


def _call_writer(plan: ToolPlan | None):
    """How calls are written in the default prompt format: the default ``<tool_call>`` JSON, or
    the model family's own format when one was chosen (``--tool-call-format``)."""
    if plan is None or plan.format_name == "qwen3-hermes":
        return format_call
    from server.tools.formats import get_format

    return get_format(plan.format_name).call_text


class _CallNames:
    """Remembers call ids seen in assistant turns, to name the results that answer them."""

    def __init__(self) -> None:
        self.by_id: dict[str, str] = {}
        self.last_legacy = 0

    def legacy_id(self) -> str:
        self.last_legacy += 1
        return f"call_function{self.last_legacy}"


def _normalize(i: int, message: ChatMessage, calls: _CallNames, images: ImageSlots | None = None) -> Msg:
    role = "system" if message.role == "developer" else message.role
    content = _text_content(i, message, images)
    if role == "assistant":
        return _assistant(i, message, content, calls)
    if role in ("tool", "function"):
        return _result(i, message, content, calls)
    if content is None:
        raise bad_request(f"Missing required parameter: 'messages[{i}].content'", f"messages[{i}].content")
    return _with_name({"role": role, "content": content}, message)


def _with_name(out: Msg, message: ChatMessage) -> Msg:
    """The speaker's ``name`` goes to the template (``server.render`` folds it into the content
    when the template ignores it)."""
    if message.name:
        out["name"] = message.name
    return out


def _text_content(i: int, message: ChatMessage, images: ImageSlots | None = None) -> str | list[Msg] | None:
    """The message's text (parts joined by newlines), or its text and image parts in order when
    the template takes image parts."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    parts: list[Msg] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and images is not None:
            if message.role != "user":
                raise bad_request(f"content part {j} of 'messages[{i}].content' is an image in a "
                                  f"{message.role!r} message: images go in user messages", f"messages[{i}].content")
            if images.placeholder is None:
                parts.append({"type": "image"})
            else:
                texts.append(images.placeholder)
        elif kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and message.role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _MEDIA_PARTS:
            raise bad_request(
                f"content part {j} of 'messages[{i}].content' is {kind!r}, but the loaded model is text-only: "
                "it takes no images, audio, video or files",
                f"messages[{i}].content",
                code="unsupported_content",
            )
        else:
            raise bad_request(
                f"Invalid content part {j} of 'messages[{i}].content': only text parts are supported "
                f"(got type {kind!r})",
                f"messages[{i}].content",
            )
    if images is not None and images.placeholder is None and any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(texts)


def _assistant(i: int, message: ChatMessage, content: str | None, calls: _CallNames) -> Msg:
    tool_calls = [_tool_call(i, j, c, calls) for j, c in enumerate(message.tool_calls or [])]
    if message.function_call is not None:
        call_id = calls.legacy_id()
        tool_calls.append(_function(f"messages[{i}].function_call", message.function_call, call_id))
        calls.by_id[call_id] = tool_calls[-1]["name"]
    if content is None and not tool_calls:
        raise bad_request(
            f"Invalid 'messages[{i}]': an assistant message needs 'content' or 'tool_calls'",
            f"messages[{i}].content",
        )
    return _with_name({"role": "assistant", "content": content or "", "calls": tool_calls}, message)


def _tool_call(i: int, j: int, raw: Any, calls: _CallNames) -> Msg:
    param = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
        raise bad_request(f"Missing required parameter: '{param}.id'", f"{param}.id")
    call = _function(f"{param}.function", raw.get("function"), raw["id"])
    calls.by_id[call["id"]] = call["name"]
    return call


def _function(param: str, raw: Any, call_id: str) -> Msg:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise bad_request(f"Missing required parameter: '{param}.name'", f"{param}.name")
    arguments = raw.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"Invalid '{param}.arguments': expected a JSON string", f"{param}.arguments")
    return {"id": call_id, "name": raw["name"], "arguments": arguments}


def _result(i: int, message: ChatMessage, content: str | None, calls: _CallNames) -> Msg:
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(
                f"Missing required parameter: 'messages[{i}].tool_call_id'", f"messages[{i}].tool_call_id"
            )
        call_id, name = message.tool_call_id, message.name or calls.by_id.get(message.tool_call_id)
    else:
        if not message.name:
            raise bad_request(f"Missing required parameter: 'messages[{i}].name'", f"messages[{i}].name")
        call_id, name = f"call_function{calls.last_legacy}", message.name
    return {"role": "tool", "content": content or "", "tool_call_id": call_id, "name": name}


def _openai_shape(message: Msg) -> Msg:
    if message["role"] != "assistant":
        return {k: v for k, v in message.items() if v is not None}
    out: Msg = {"role": "assistant", "content": message["content"]}
    if message.get("name"):
        out["name"] = message["name"]
    if message["calls"]:
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": _decoded(c["arguments"])},
            }
            for c in message["calls"]
        ]
    return out


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _default_shape(message: Msg, write_call=format_call) -> Msg:
    if message["role"] == "tool":
        return {"role": "user", "content": format_response(message["content"]), "_result": True}
    if message["role"] != "assistant":
        return message
    calls = CALL_SEPARATOR.join(write_call(c["name"], c["arguments"].strip() or "{}") for c in message["calls"])
    text = "\n".join(part for part in (message["content"], calls) if part)
    out = {"role": "assistant", "content": text}
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _merge_results(messages: list[Msg]) -> list[Msg]:
    """Consecutive tool results become one user message (templates may require alternation)."""
    out: list[Msg] = []
    for message in messages:
        if message.get("_result") and out and out[-1].get("_result"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + message["content"]}
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "_result"} for m in out]


def _with_system(messages: list[Msg], prompt: str) -> list[Msg]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
