"""Column names the pipeline writes itself: an input column by one of these names can be
neither passed through nor a template variable (JobSpec refuses it, naming it).

The list is pipeline.batch.stages.schema.RESERVED_COLUMNS (the read stage's, the prompt
stage's and every output column), written out here because the spec sits below batch;
tests/unit/test_reserved_columns.py keeps the two equal."""

RESERVED_COLUMNS: frozenset[str] = frozenset(
    {
        "_images",
        "_row",
        "actor_id",
        "adapter",
        "cached_prompt_tokens",
        "completion_token_ids",
        "completion_tokens",
        "cost_usd",
        "decode_s",
        "embedding",
        "engine",
        "error",
        "finish_reason",
        "finished_at",
        "gpu_seconds",
        "id",
        "latency_s",
        "list_price_usd",
        "logprobs",
        "max_tokens",
        "messages",
        "model",
        "num_samples",
        "parsed",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_tokens",
        "queue_s",
        "reasoning",
        "reasoning_effort",
        "reasoning_tokens",
        "response_format",
        "samples",
        "seed",
        "spec_accepted_tokens",
        "spec_proposed_tokens",
        "spec_verifications",
        "temperature",
        "text",
        "tool_calls",
        "tool_plan",
        "top_k",
        "top_p",
        "ttft_s",
    }
)
