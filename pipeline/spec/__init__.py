"""JobSpec: the one YAML file that describes a batch job.

Strict on purpose (`extra="forbid"` everywhere): a misspelled key in a nightly job must fail
before any actor starts, with the field path, not be silently ignored. Every field carries a
description; docs/job-spec.md is generated from them (`python -m pipeline.spec.docgen`).

One module per part: `base` (the strict base model, SpecError, validation messages), a module
per section of the file (`input`, `prompt`, `model`, `engine`, `sampling`, `resources`,
`output`, `storage`, `cost` with `limits`), `job` (JobSpec: the sections together and the
rules that span them), `load` (reading a file: `{{ date }}`, YAML, `${VAR}`, `--set`,
validation) and `docgen` (docs/job-spec.md). Import the names from here.
"""

from pipeline.spec.base import SpecError, format_validation_error
from pipeline.spec.cost import CostSpec, LimitsSpec, PricePerMillion
from pipeline.spec.engine import EngineSpec, SpeculativeSpec
from pipeline.spec.input import InputSpec
from pipeline.spec.job import EmbedSpec, JobSpec, reserved_columns
from pipeline.spec.load import (
    apply_overrides,
    env_references,
    load_job_spec,
    load_yaml,
    parse_job_spec,
    render_date,
    today_utc,
)
from pipeline.spec.model import ModelSpec
from pipeline.spec.output import OutputSpec
from pipeline.spec.prompt import PromptSpec
from pipeline.spec.resources import ResourcesSpec
from pipeline.spec.sampling import SamplingSpec
from pipeline.spec.storage import StorageSpec

__all__ = [
    "CostSpec",
    "EmbedSpec",
    "EngineSpec",
    "InputSpec",
    "JobSpec",
    "LimitsSpec",
    "ModelSpec",
    "OutputSpec",
    "PricePerMillion",
    "PromptSpec",
    "ResourcesSpec",
    "SamplingSpec",
    "SpecError",
    "SpeculativeSpec",
    "StorageSpec",
    "apply_overrides",
    "env_references",
    "format_validation_error",
    "load_job_spec",
    "load_yaml",
    "parse_job_spec",
    "render_date",
    "reserved_columns",
    "today_utc",
]
