"""Our tool-call parsers against vLLM's parsers of the same name (vllm.tool_parsers: hermes,
llama3_json), whole answers: the same calls (names, arguments as objects) and the same
content, on outputs written the way each family writes them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from pipeline.openai.tools import PARSERS

pytestmark = pytest.mark.vllm

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
CASES = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC", "nested": {"a": [1, 2]}}}'
        "</tool_call>",
        "No call here, just text.",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {}}',
        "No call here, just text.",
    ],
}


def _theirs(name: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from engines.dev.tiny import make_tiny_model

    model = _MODEL.get("dir")
    if model is None:
        model = _MODEL["dir"] = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    # Llama 3's parser looks its tag up in the vocabulary (a real Llama 3 tokenizer has it).
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
    )
    parser = ToolParserManager.get_tool_parser(name)(tokenizer, request.tools)
    info = parser.extract_tool_calls(text, request)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    return info.content, calls


_MODEL: dict[str, Path] = {}


@pytest.mark.parametrize(("name", "i"), [(n, i) for n, cases in CASES.items() for i in range(4)])
def test_same_calls_and_content_as_vllms_parser(name: str, i: int) -> None:
    text = CASES[name][i]
    content, calls = PARSERS[name].parse(text)
    ours = [(c.name, json.loads(c.arguments)) for c in calls]
    their_content, theirs = _theirs(name, text)
    assert ours == theirs
    norm = lambda s: (s or "").strip() or None  # noqa: E731 (both strip around calls)
    assert norm(content) == norm(their_content)
