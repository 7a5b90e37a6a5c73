"""The `prompt` section: how rows become prompts (template, system prompt, chat template,
reasoning)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engines.strict import StrictModel
from pipeline.spec.images import ImagesSpec


class PromptSpec(StrictModel):
    template: str | None = Field(
        None,
        description="Jinja2 template applied to each row to build the user prompt, e.g. "
        "'Summarize: {{ text }}'. Row columns are the variables; `prompt` is the prompt "
        "column's value. Null uses the prompt column as is.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message prepended to every chat (when chat_template is on) unless "
        "the chat already starts with one.",
    )
    chat_template: bool = Field(
        True,
        description="Apply the model tokenizer's chat template (with the generation prompt). "
        "Off: the prompt text is tokenized as is (messages are rejected).",
    )
    reasoning: Literal["none", "think", "harmony"] = Field(
        "none",
        description="How the model writes its reasoning before its answer: none | think "
        "(Qwen3, QwQ, DeepSeek-R1: a <think>...</think> block, which the chat template may "
        "open) | harmony (GPT-OSS: analysis and final channels). Set, output rows get "
        "`reasoning` (null when a row's output has none) and `reasoning_tokens` columns and "
        "`text` holds the answer alone; Serve answers carry `reasoning_content` and "
        "usage.completion_tokens_details.reasoning_tokens. Reasoning tokens are output tokens "
        "(counts and cost unchanged). The model's tokenizer must have the format's tokens "
        "(checked before the job starts).",
    )
    enable_thinking: bool | None = Field(
        None,
        description="Passed to the chat template as `enable_thinking` (Qwen3's switch: false "
        "asks for the answer without reasoning). Null: not passed (the template's default).",
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="Passed to the chat template as `reasoning_effort` (GPT-OSS's `Reasoning: "
        "low|medium|high`). Null: not passed. A row may set its own through "
        "sampling.overrides.reasoning_effort.",
    )
    tool_parser: Literal["hermes", "llama3_json", "harmony"] | None = Field(
        None,
        description="How the model writes tool calls, read from answers to requests with "
        "tools (tool_choice auto): hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, "
        "Hermes) | llama3_json (Llama 3.1+'s JSON calls) | harmony (GPT-OSS: messages to "
        "functions.NAME; needs reasoning: harmony, whose split reads them). Null: chosen from "
        "the markers the chat template renders (hermes when it shows none). See docs/tools.md.",
    )

    tools: list[dict[str, Any]] | None = Field(
        None,
        description="Function tools offered to every row, in OpenAI's chat shape ({type: "
        "function, function: {name, description, parameters}}); the chat template renders "
        "them. A row's own (an openai_batch line's body.tools, or the "
        "sampling.overrides.tools column) replace them. Output rows get a `tool_calls` column "
        "(JSON text of OpenAI's tool_calls, null when the answer made none) and finish_reason "
        "tool_calls. Checked before the job starts. See docs/tools.md.",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="none | auto | required | {type: function, function: {name}} (OpenAI's "
        "tool_choice) for rows with tools. Null: auto. required and a named function "
        "constrain the output to valid calls (structured output); they cannot be combined "
        "with a response_format. A row may set its own (sampling.overrides.tool_choice).",
    )
    parallel_tool_calls: bool | None = Field(
        None,
        description="Whether an answer may make several calls (OpenAI's parallel_tool_calls). "
        "Null: yes.",
    )
    images: ImagesSpec = Field(
        default_factory=ImagesSpec,
        description="Where images in prompts may come from and their limits (image_url "
        "parts of messages, input.image_columns); see docs/images.md.",
    )

    @model_validator(mode="after")
    def _harmony_calls_need_the_harmony_split(self) -> PromptSpec:
        # The calls are special-token messages only the harmony split reads (docs/tools.md).
        if self.tool_parser == "harmony" and self.reasoning != "harmony":
            raise ValueError(
                "prompt.tool_parser harmony reads GPT-OSS's calls from the harmony split: "
                "set prompt.reasoning: harmony too"
            )
        return self

    @field_validator("template")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("prompt.template is empty; remove it or write a template")
        import jinja2

        try:
            jinja2.Environment().parse(value)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"prompt.template line {exc.lineno}: {exc.message}") from None
        return value

    def template_kwargs(self, reasoning_effort: str | None = None) -> dict[str, Any] | None:
        """Extra chat template variables (enable_thinking, reasoning_effort; a row's own
        effort over the job's); None when there are none."""
        kwargs: dict[str, Any] = {}
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        effort = reasoning_effort or self.reasoning_effort
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return kwargs or None

    def template_variables(self) -> list[str]:
        """Names the template reads (row columns, plus `prompt`), sorted; [] without one."""
        if self.template is None:
            return []
        import jinja2
        from jinja2 import meta

        return sorted(meta.find_undeclared_variables(jinja2.Environment().parse(self.template)))
