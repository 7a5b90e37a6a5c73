"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): what a request asks
(request.py), the structured-output schema that makes a required or named call always parse
(constrain.py), the parsers that find calls in what a model wrote (parsers.py), and the
streamed form (stream.py). Pure: no Ray, no FastAPI, no engine; Serve and batch both use it."""

from pipeline.openai.tools.constrain import call_schema, calls_from_constrained
from pipeline.openai.tools.parsers import PARSERS, ToolParser, choose_parser
from pipeline.openai.tools.request import ToolCall, ToolError, ToolPlan, read_tools
from pipeline.openai.tools.stream import ToolStream, answer_calls

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolError",
    "ToolParser",
    "ToolPlan",
    "ToolStream",
    "answer_calls",
    "call_schema",
    "calls_from_constrained",
    "choose_parser",
    "read_tools",
]
