"""Tool-call parsers per model family: from what a model wrote (tool_choice auto), its calls
and the content around them. A call that does not parse leaves the text as plain content, as
vLLM's parsers do: a request never fails because a model wrote a broken call.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
  them is content (Qwen2.5, Qwen3, Hermes and the many templates that copied them);
- llama3_json: Llama 3.1+'s JSON calls, `{"name": ..., "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several separated by `;`; the text is calls
  only when it starts with one;
- harmony (GPT-OSS): calls are messages addressed to `functions.NAME`, written with special
  tokens the answer's text no longer holds: the harmony reasoning split reads them from the
  token ids (pipeline.openai.reasoning, `Split.calls`), and this parser takes them from there
  (`split_calls`); the text is all content. It needs `prompt.reasoning: harmony`.

choose_parser picks one from the model's chat template (the markers it renders), or the one the
config names. Each parser also tells a stream where a call may be starting (stream.py), so
content before a call is sent as it comes and the call itself is held back whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.openai.markers import marker_prefix_len
from pipeline.openai.tools.request import ToolCall


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (an object, or a string holding one); None: not that."""
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, *arg_keys: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = next((obj[k] for k in arg_keys if k in obj), {})
    arguments = _arguments(raw)
    return None if arguments is None else ToolCall(obj["name"], arguments)


@dataclass(frozen=True)
class ToolParser:
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole answer."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of a streamed answer so far is surely content (no call starts in it)."""
        raise NotImplementedError


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    START = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in _HERMES.findall(text):
            try:
                call = _call(json.loads(body), "arguments", "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a broken call: the whole text is content
            calls.append(call)
        content = _HERMES.sub("", text).strip()
        return (content or None), calls

    def safe_prefix(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - marker_prefix_len(text, self.START)


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        head = ""
        if self.TAG in body:
            head, body = body.split(self.TAG, 1)
            body = body.strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return (head.strip() or None), calls

    def safe_prefix(self, text: str) -> int:
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag
        if not text.strip() or text.lstrip().startswith("{"):
            return 0  # nothing yet, or a call under way
        return len(text) - marker_prefix_len(text, self.TAG)


class HarmonyToolParser(ToolParser):
    """GPT-OSS: the calls come from the harmony split (`Split.calls`), never from the text."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return text, []

    def safe_prefix(self, text: str) -> int:
        return len(text)  # the text holds no call: all of it streams as it comes

    def split_calls(
        self, text: str, found: Sequence[tuple[str, str]]
    ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from the answer's text and the split's calls: a call whose
        arguments are not a JSON object stays content, as a broken call does for every parser."""
        calls, broken = [], []
        for name, raw in found:
            arguments = _arguments(raw)
            if name and arguments is not None:
                calls.append(ToolCall(name, arguments))
            else:
                broken.append(raw)
        content = "\n".join(part for part in (text, *broken) if part)
        return content or None, calls


PARSERS: dict[str, ToolParser] = {
    "hermes": HermesParser("hermes"),
    "llama3_json": Llama3JsonParser("llama3_json"),
    "harmony": HarmonyToolParser("harmony"),
}


def choose_parser(chat_template: str | None, configured: str | None = None) -> ToolParser:
    """The parser the config names, else the one the chat template's markers show, else
    hermes (the most common format, and what a template without tools gets)."""
    if configured is not None:
        if configured not in PARSERS:
            raise ValueError(
                f"tool_parser {configured!r} is not one of {', '.join(sorted(PARSERS))}"
            )
        return PARSERS[configured]
    template = chat_template or ""
    if "<|channel|>" in template:  # harmony's messages (GPT-OSS)
        return PARSERS["harmony"]
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
