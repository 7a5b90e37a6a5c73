"""What a Ray Data processor (pipeline.data) runs of batch: the prompt stage, the row
stage and the output schema, with the column names they share."""

from pipeline.batch.columns import ADAPTER, ERROR, ID, MESSAGES, PROMPT, ROW
from pipeline.batch.driver.plan import check_reasoning
from pipeline.batch.stages.generate import RowServer, current_actor_id, reasoning_parser
from pipeline.batch.stages.prompts import PromptStage
from pipeline.batch.stages.read.cells import (
    adapter_cell,
    apply_overrides,
    messages_value,
    text_prompt,
)
from pipeline.batch.stages.read.parquet import columns_needed
from pipeline.batch.stages.rows import GenerateConfig, outcomes_to_table
from pipeline.batch.stages.schema import job_output_schema
from pipeline.batch.stages.tools import check_job_tools

__all__ = [
    "ADAPTER",
    "ERROR",
    "ID",
    "MESSAGES",
    "PROMPT",
    "ROW",
    "GenerateConfig",
    "PromptStage",
    "RowServer",
    "adapter_cell",
    "apply_overrides",
    "check_job_tools",
    "check_reasoning",
    "columns_needed",
    "current_actor_id",
    "job_output_schema",
    "messages_value",
    "outcomes_to_table",
    "reasoning_parser",
    "text_prompt",
]
