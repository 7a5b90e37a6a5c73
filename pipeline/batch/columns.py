"""The batch row contract: the column names every stage shares. What the readers write (ROW,
CORE_COLUMNS, BODY_SAMPLING and the openai_batch override columns), then what the prompt
stage adds (STAGE_COLUMNS). A leaf: it imports nothing, so every stage and the commit protocol
can import it without a cycle."""

from __future__ import annotations

ROW = "_row"
ID = "id"
PROMPT = "prompt"
MESSAGES = "messages"
ERROR = "error"
CORE_COLUMNS = (ID, PROMPT, MESSAGES, ERROR)
# Jobs with model.adapters: the LoRA adapter a row runs with (input.adapter_column, or an
# openai_batch line's body.model); null: the model itself.
ADAPTER = "adapter"
# The row's own values of the shared table's parameters (pipeline.openai.params: penalties,
# min_p, min_tokens, logit_bias, bad_words, stop, stop_token_ids), from an openai_batch body or
# `sampling.overrides` columns, as canonical JSON text of SamplingParams values; null: none.
BODY_SAMPLING = "body_sampling"

# openai_batch: sampling field -> the column its per-request value lands in.
BATCH_OVERRIDE_COLUMNS: dict[str, str] = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "response_format": "response_format",
    "logprobs": "logprobs",
    "n": "num_samples",
    "reasoning_effort": "reasoning_effort",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
}
# The Python type each overridable sampling field is coerced to.
OVERRIDE_TYPES: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "logprobs": int,
    "n": int,
    "response_format": str,  # JSON text; read and checked by the prompt stage
    "reasoning_effort": str,  # low | medium | high; checked by the prompt stage
    # A row's tools (JSON text of OpenAI's chat tools) and tool_choice (a word, or JSON text
    # of {type: function, function: {name}}); read and checked by the prompt stage.
    "tools": str,
    "tool_choice": str,
    "parallel_tool_calls": bool,  # openai_batch lines only
}

# --- what the prompt stage adds ---------------------------------------------------------------
PROMPT_TOKEN_IDS = "prompt_token_ids"
PROMPT_TOKENS = "prompt_tokens"
MAX_TOKENS = "max_tokens"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
SEED = "seed"
RESPONSE_FORMAT = "response_format"
LOGPROBS = "logprobs"
SAMPLES = "num_samples"  # sampling field `n` (a column named "n" is too likely an input's)
REASONING_EFFORT = "reasoning_effort"
SAMPLING_COLUMNS = (
    MAX_TOKENS,
    TEMPERATURE,
    TOP_P,
    TOP_K,
    SEED,
    RESPONSE_FORMAT,
    LOGPROBS,
    SAMPLES,
    REASONING_EFFORT,
)
# Rows with tools: how their calls are made and read, as JSON text ({tools, mode, forced,
# parallel, parser}: pipeline.batch.stages.tools); null: the row has no tools.
TOOL_PLAN = "tool_plan"
# The response_format cell of a row that asks for free text although the job has a format.
FREE_TEXT = '{"type": "text"}'
# Rows with images: each image as the engine takes it (pixels float32 bytes, patch grid,
# content digest: engines.api.ImageInput), in placeholder order; empty for text rows. Never
# written to the output.
IMAGES = "_images"
STAGE_COLUMNS = (PROMPT_TOKEN_IDS, PROMPT_TOKENS, *SAMPLING_COLUMNS, TOOL_PLAN, IMAGES)

# Start of the error of a row whose prompt + max_tokens exceed the context (plan counts them).
TOO_LONG = "too long"
