"""JobSpec: the whole job file, its sections and the rules that span several of them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engines.api import EmbedParams, EngineError
from engines.parallel import DEVICE_FACTORS, engine_devices
from engines.settings import MODEL_KINDS
from engines.strict import StrictModel
from pipeline.spec.cost import CostSpec, LimitsSpec
from pipeline.spec.engine import EngineSpec
from pipeline.spec.input import InputSpec
from pipeline.spec.model import ModelSpec
from pipeline.spec.output import OutputSpec
from pipeline.spec.prompt import PromptSpec
from pipeline.spec.reserved import RESERVED_COLUMNS
from pipeline.spec.resources import ResourcesSpec
from pipeline.spec.sampling import SamplingSpec
from pipeline.spec.storage import StorageSpec


def reserved_columns() -> frozenset[str]:
    """Column names the pipeline writes itself (pipeline.spec.reserved)."""
    return RESERVED_COLUMNS


class EmbedSpec(StrictModel):
    pooling: Literal["last", "mean"] | None = Field(
        None,
        description="task embed: how the prompt's final hidden states become one vector: "
        "last (the last prompt token's) or mean (over the prompt's tokens). Null: the model's "
        "own (its sentence-transformers modules.json where it has one, else last).",
    )
    normalize: bool | None = Field(
        None,
        description="task embed: L2-normalise each embedding. Null: the model's own (its "
        "sentence-transformers Normalize module where it has modules.json, else true).",
    )


# Sampling settings that shape generated text and mean nothing for an embedding.
_GENERATION_ONLY = ("response_format", "logprobs", "prompt_logprobs")


class JobSpec(StrictModel):
    name: str = Field(
        description="Job name: letters, digits, '-', '_' and '.'; used in submission ids.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
    )
    date: str | None = Field(
        None,
        description="Run date (YYYY-MM-DD) substituted for {{ date }} anywhere in the file "
        "(and in --set values). Precedence: --date, --set date=..., this field, today (UTC).",
        pattern=r"^\d{4}-\d{2}-\d{2}$",
    )
    input: InputSpec = Field(description="Where the prompts are and how to read them.")
    prompt: PromptSpec = Field(default_factory=PromptSpec, description="How rows become prompts.")
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="generate: complete every prompt (text, finish_reason, token counts). "
        "embed: compute every prompt's embedding instead (prefill only, engine.kind "
        "reference): rows get an `embedding` column (list<float32>), `text` is empty, "
        "finish_reason is stop (or error), completion_tokens 0; sampling is not used.",
    )
    embed: EmbedSpec = Field(
        default_factory=EmbedSpec, description="Pooling and normalisation of task embed."
    )
    model: ModelSpec = Field(description="The model to generate with.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine and its settings.")
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling defaults and per-row overrides."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Actor pool and batching."
    )
    output: OutputSpec = Field(description="Where the results go.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec, description="Object storage endpoint (no credentials)."
    )
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description="Failure thresholds.")
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices, budget, cost split.")

    @model_validator(mode="after")
    def _engine_devices(self) -> JobSpec:
        """The engine's parallel sizes (engine.extra) must span exactly the GPUs each actor
        reserves: more would wait for GPUs never given, fewer would pay for idle ones."""

        try:
            needed = engine_devices(self.engine.kind, self.engine.extra)
        except EngineError as exc:
            raise ValueError(str(exc)) from exc
        reserved = self.resources.devices_per_actor
        factors = DEVICE_FACTORS.get(self.engine.kind, ())
        if not factors or (needed == 1 and reserved <= 1):
            return self  # one device (or a fraction, or none): nothing spans several
        if needed != reserved:
            sizes = " x ".join(f"{name} {self.engine.extra.get(name) or 1}" for name in factors)
            raise ValueError(
                f"engine.extra parallel sizes ({sizes} = {needed} device(s)) must equal "
                f"resources.devices_per_actor ({reserved:g}); change one of them"
            )
        return self

    @model_validator(mode="after")
    def _embed_task(self) -> JobSpec:
        """task embed: an engine that embeds, and no generation-only setting that would be
        silently ignored."""
        if self.task != "embed":
            return self
        if self.engine.kind != "reference":
            raise ValueError(
                f"task embed: engine.kind {self.engine.kind} does not compute embeddings "
                "(vLLM embeds only in its pooling runner, a separate engine that cannot "
                "generate; the TensorRT-LLM adapter has no pooling); use engine.kind reference"
            )
        sampling = self.sampling
        asked = [name for name in _GENERATION_ONLY if getattr(sampling, name) is not None]
        if sampling.n != 1 or "n" in sampling.overrides:
            asked.append("n")
        if self.engine.speculative is not None:
            asked.append("engine.speculative")
        if self.prompt.reasoning != "none":
            asked.append("prompt.reasoning")
        if self.output.include_token_ids:
            asked.append("output.include_token_ids")
        if asked:
            raise ValueError(
                f"task embed computes no output tokens, so {', '.join(asked)} cannot apply; "
                "remove them or use task generate"
            )
        return self

    @model_validator(mode="after")
    def _adapters(self) -> JobSpec:
        """LoRA adapters: an engine that runs them, a task that uses them, a way to pick one."""
        if not self.model.has_adapters:
            if self.input.adapter_column:
                raise ValueError(
                    "input.adapter_column names rows' LoRA adapters, but model.adapters is "
                    "empty (and no model.adapter_prefix); list the adapters there or remove "
                    "input.adapter_column"
                )
            return self
        if self.engine.kind not in MODEL_KINDS:
            raise ValueError(
                f"model.adapters: engine.kind {self.engine.kind} runs no model, so no LoRA "
                f"adapters; use one of {', '.join(MODEL_KINDS)}"
            )
        if self.task == "embed":
            raise ValueError("model.adapters: adapters apply to task generate, not embed")
        if self.model.display_name in self.model.adapters:
            raise ValueError(
                f"model.adapters: {self.model.display_name!r} is the model's own name; give "
                "the adapter another"
            )
        if self.input.format != "openai_batch" and not self.input.adapter_column:
            raise ValueError(
                "model.adapters: set input.adapter_column, the column naming each row's "
                "adapter (openai_batch lines name theirs in body.model)"
            )
        return self

    @property
    def embed_params(self) -> Any:
        """engines.api.EmbedParams for task embed; None for task generate."""
        if self.task != "embed":
            return None

        return EmbedParams(pooling=self.embed.pooling, normalize=self.embed.normalize)

    @model_validator(mode="after")
    def _prompt_source(self) -> JobSpec:
        inp, prompt = self.input, self.prompt
        clashes = sorted(set(inp.passthrough_columns) & reserved_columns())
        if clashes:
            raise ValueError(
                f"input.passthrough_columns: {clashes} are written by the pipeline itself; "
                "rename those input columns"
            )
        sampling = self.sampling
        if (
            self.engine.kind == "trtllm"
            and self.engine.extra.get("backend", "pytorch") != "pytorch"
            and (sampling.logprobs is not None or "logprobs" in sampling.overrides)
        ):
            raise ValueError(
                "sampling.logprobs: engine.kind trtllm returns logprobs on its pytorch backend "
                "only (engine.extra.backend); use backend pytorch, or engine.kind reference or "
                "vllm"
            )
        if self.engine.kind == "trtllm" and sampling.prompt_logprobs is not None:
            raise ValueError(
                "sampling.prompt_logprobs: engine.kind trtllm does not return the prompt "
                "tokens' own logprobs; use engine.kind reference or vllm"
            )
        if self.engine.kind == "synthetic" and sampling.response_format is not None:
            # Every row would be a row error: say so before the job starts.
            raise ValueError(
                "sampling.response_format: engine.kind synthetic generates random tokens and "
                "cannot constrain them; remove response_format or use another engine kind"
            )
        if self.output.format == "openai_batch" and (
            inp.format != "openai_batch" or "url" not in inp.passthrough_columns
        ):
            raise ValueError(
                "output.format openai_batch answers OpenAI Batch API requests: it needs "
                "input.format openai_batch and `url` in input.passthrough_columns (the url "
                "says whether a request gets a chat.completion or a text_completion)"
            )
        if inp.format == "openai_batch":
            if prompt.template is not None:
                raise ValueError(
                    "prompt.template does not apply to input.format openai_batch (the request "
                    "body holds the prompt); remove prompt.template"
                )
            return self
        if inp.messages_column and prompt.template is not None:
            raise ValueError(
                "prompt.template builds a text prompt, but input.messages_column gives whole "
                "chats; remove one of them"
            )
        if inp.messages_column and not prompt.chat_template:
            raise ValueError(
                "input.messages_column needs prompt.chat_template: true (chats are rendered "
                "with the tokenizer's chat template)"
            )
        if inp.image_columns and (inp.messages_column or inp.format == "openai_batch"):
            raise ValueError(
                "input.image_columns adds images to a text prompt; chats (messages, "
                "openai_batch lines) carry their images as image_url content parts instead"
            )
        if inp.image_columns and not prompt.chat_template:
            raise ValueError(
                "input.image_columns needs prompt.chat_template: true (the chat template "
                "places each image's placeholder)"
            )
        if not (inp.prompt_column or inp.messages_column or prompt.template):
            raise ValueError(
                "no prompt source: set input.prompt_column, input.messages_column, or "
                "prompt.template (built from row columns)"
            )
        variables = prompt.template_variables()
        bad = sorted(set(variables) & reserved_columns() - {"prompt"})
        if bad:
            raise ValueError(
                f"prompt.template uses {bad}, which are pipeline column names; only input "
                "columns and `prompt` can be template variables"
            )
        if "prompt" in variables and not inp.prompt_column:
            raise ValueError("prompt.template uses {{ prompt }} but input.prompt_column is not set")
        return self

    def template_columns(self) -> list[str]:
        """Input columns the prompt template reads (besides the prompt column), sorted."""
        return [v for v in self.prompt.template_variables() if v != "prompt"]

    def prompt_columns(self) -> list[str]:
        """Input columns a row's prompt is made of besides its prompt or messages column: the
        template's variables, then the image columns."""
        names = [*self.template_columns(), *self.input.image_columns]
        return list(dict.fromkeys(names))
