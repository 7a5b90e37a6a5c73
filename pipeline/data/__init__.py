"""The Ray Data face of tokenmill: its engines as a Dataset step, its outputs as Datasets.

    from pipeline.data import build_processor, read_output

    processor = build_processor("job.yaml")            # or a ProcessorConfig / dict
    ds = processor(ray.data.read_parquet("s3://bucket/prompts/"))
    rows = read_output("s3://bucket/out/2026-12-02/")  # the committed parts only

See docs/python-api.md. Ray Data is imported when these are called, not on import.
"""

from pipeline.data.config import DatasetColumns, ProcessorConfig
from pipeline.data.output import OutputIncomplete, OutputNotFound, read_output
from pipeline.data.processor import Processor, build_processor

__all__ = [
    "DatasetColumns",
    "OutputIncomplete",
    "OutputNotFound",
    "Processor",
    "ProcessorConfig",
    "build_processor",
    "read_output",
]
