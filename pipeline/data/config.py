"""ProcessorConfig: what `build_processor` takes, the job file's sections minus input and output.

A Dataset processor has no input files and writes nothing: the Dataset is its input and its
result. So it takes the sections of a job file that say how rows become prompts and how they
are generated and costed (prompt, model, engine, sampling, resources, cost, storage), the same
pydantic models and as strict, plus `input`: which columns of the Dataset hold the id and the
prompt. A job YAML path works too: its input columns are taken, its input files and output
prefix are not used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from engines.strict import StrictModel
from pipeline.spec import (
    CostSpec,
    EngineSpec,
    JobSpec,
    ModelSpec,
    PromptSpec,
    ResourcesSpec,
    SamplingSpec,
    SpecError,
    StorageSpec,
    format_validation_error,
    load_job_spec,
)

# The JobSpec a processor's rows are prepared with has no files: these stand where a job's
# input and output URIs would (nothing opens them).
NO_FILES = "dataset"
JOB_NAME = "dataset-processor"


class DatasetColumns(StrictModel):
    id_column: str | None = Field(
        None,
        description="Column holding a unique, stable row id (written to `id` as text). Null: "
        "the id is derived from the values of the prompt's columns, so the same prompt gets "
        "the same id (and, with sampling.seed, the same sample).",
    )
    prompt_column: str | None = Field(
        None,
        description="Column with the prompt text. Set this or messages_column (or neither, "
        "when prompt.template builds the prompt from other columns).",
    )
    messages_column: str | None = Field(
        None,
        description="Column with a chat as a list of {role, content} (or its JSON text).",
    )
    adapter_column: str | None = Field(
        None,
        description="Column naming each row's LoRA adapter (one of model.adapters); null or "
        "empty: the model itself.",
    )
    image_columns: list[str] = Field(
        default_factory=list,
        description="Columns of image bytes or URL strings shown, in order, before the row's "
        "text prompt (a vision-language model; docs/images.md). Chats carry image_url parts.",
    )


class ProcessorConfig(StrictModel):
    input: DatasetColumns = Field(
        default_factory=DatasetColumns, description="Which Dataset columns hold id and prompt."
    )
    prompt: PromptSpec = Field(default_factory=PromptSpec, description="How rows become prompts.")
    model: ModelSpec = Field(description="The model to generate with.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine and its settings.")
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling defaults and per-row overrides."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="The engine actor pool: num_actors, or min_actors and max_actors to "
        "autoscale; cpus_per_actor, devices_per_actor (GPUs, on one node), actor_resources, "
        "batch_size (rows per Ray Data batch), max_in_flight (requests per engine), "
        "max_restarts and max_task_retries. The fields about shards (prompt_actors, "
        "tail_split, placement) belong to `tokenmill run` and are not used.",
    )
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices and the cost split.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec, description="Object storage for s3:// models."
    )
    include_token_ids: bool = Field(
        False, description="Also write completion_token_ids (list<int32>) per row."
    )

    def job_spec(self) -> JobSpec:
        """The JobSpec the batch path's prompt stage, row server and schema take: this
        config's sections, and stand-ins for the input and output files a processor has not.
        Its validators run too, so a processor refuses what a job would (no prompt source, a
        template over pipeline columns, settings an engine kind lacks)."""
        data: dict[str, Any] = {
            "name": JOB_NAME,
            "input": {"uri": NO_FILES, **self.input.model_dump()},
            "output": {
                "uri": NO_FILES,
                "include_token_ids": self.include_token_ids,
                "report": False,
            },
            **{name: getattr(self, name) for name in _SHARED_SECTIONS},
        }
        try:
            return JobSpec.model_validate(data)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc, "processor config")) from None


_SHARED_SECTIONS = ("prompt", "model", "engine", "sampling", "resources", "cost", "storage")


def processor_config(config: ProcessorConfig | dict[str, Any] | str | Path) -> ProcessorConfig:
    """A ProcessorConfig from itself, a mapping of its sections, or a job YAML path.

    Raises SpecError naming the field, as a job file's loading does."""
    if isinstance(config, ProcessorConfig):
        config.job_spec()  # refuse now what the actors would refuse later
        return config
    if isinstance(config, (str, Path)):
        return from_job(load_job_spec(config))
    if not isinstance(config, dict):
        raise SpecError(
            "build_processor: config must be a ProcessorConfig, a dict of its sections or a "
            f"job YAML path, got {type(config).__name__}"
        )
    try:
        parsed = ProcessorConfig.model_validate(config)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, "processor config")) from None
    parsed.job_spec()
    return parsed


def from_job(spec: JobSpec) -> ProcessorConfig:
    """A job file's sections as a processor's: its input columns, not its files or output."""
    if spec.input.format == "openai_batch":
        raise SpecError(
            "input.format openai_batch: a Dataset processor reads prompt or messages columns; "
            "run OpenAI batch files with `tokenmill run`"
        )
    config = ProcessorConfig(
        input=DatasetColumns(
            id_column=spec.input.id_column,
            prompt_column=spec.input.prompt_column,
            messages_column=spec.input.messages_column,
        ),
        include_token_ids=spec.output.include_token_ids,
        **{name: getattr(spec, name) for name in _SHARED_SECTIONS},
    )
    config.job_spec()
    return config
