"""What the OpenAI Batch API (pipeline.serve.batch_api) needs of batch: the request lines
it accepts and the output files it exports."""

from pipeline.batch.driver.openai_output import LineContext, expected_exports, export_committed
from pipeline.batch.stages.read.openai_batch import (
    EMBEDDINGS_URL,
    SUPPORTED_BATCH_URLS,
    parse_batch_request,
)

__all__ = [
    "EMBEDDINGS_URL",
    "SUPPORTED_BATCH_URLS",
    "LineContext",
    "expected_exports",
    "export_committed",
    "parse_batch_request",
]
