"""The `engine` section: the engine kind and its settings, speculative decoding included."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engines.settings import common_default, spec_description
from engines.speculative import problems
from engines.strict import StrictModel
from engines.synthetic.settings import SyntheticSettings


class SpeculativeSpec(StrictModel):
    method: Literal["ngram", "draft", "eagle3", "mtp"] = Field(
        description="ngram (prompt lookup: propose the tokens that followed the last match of "
        "the request's own recent tokens in its prompt + output; no second model) | draft (a "
        "small model with the same tokenizer proposes) | eagle3 (an EAGLE-3 head proposes) | "
        "mtp (the checkpoint's multi-token-prediction layers). Engine kinds: reference ngram, "
        "draft; vllm ngram, draft; trtllm ngram, draft, eagle3, mtp. See "
        "docs/speculative-decoding.md."
    )
    num_tokens: int | None = Field(
        None,
        ge=1,
        le=32,
        description="Tokens proposed per request per step; the target model scores them all "
        "(plus one) in one forward pass. Null: 4 (mtp: num_layers).",
    )
    prompt_lookup_min: int | None = Field(
        None,
        ge=1,
        description="ngram: shortest match (in tokens) of the request's last tokens that may "
        "propose. Null: 2 (trtllm matches down to 1 and needs null or 1).",
    )
    prompt_lookup_max: int | None = Field(
        None,
        ge=1,
        description="ngram: longest match tried first (longer matches propose more reliably). "
        "Null: 4 (trtllm: max_matching_ngram_size).",
    )
    model: str | None = Field(
        None,
        description="draft: the draft model directory (same tokenizer as the model); eagle3: the "
        "EAGLE-3 head checkpoint directory. Local paths on every node.",
    )
    num_layers: int | None = Field(
        None,
        ge=1,
        description="mtp: MTP layers used (trtllm num_nextn_predict_layers; each proposes "
        "one token). Null: num_tokens.",
    )
    disable_above_batch_size: int | None = Field(
        None,
        ge=0,
        description="Speculate only in engine steps with at most this many running requests: "
        "verification costs compute, which a large batch no longer has spare. Null: the engine "
        "kind's default (reference 8, measured on CPU, see docs/speculative-decoding.md; trtllm "
        "always on). Not available on vllm 0.32.",
    )


class EngineSpec(StrictModel):
    kind: Literal["reference", "trtllm", "vllm", "synthetic"] = Field(
        "reference",
        description="reference (PyTorch, runs anywhere incl. CPU) | trtllm (TensorRT-LLM, GPU) | "
        "vllm (vLLM's async engine; CPU or CUDA build installed separately) | synthetic (a test "
        "and capacity tool, no model: random token ids at a set rate, to drive the pipeline at "
        "GPU speed on CPUs; its settings go in `extra`: tokens_per_s, ttft_ms, ttft_jitter, "
        "step_interval_ms, output_tokens, stop_fraction, error_fraction, seed, script "
        "(max_batch_size and max_model_len apply as for the other kinds; see docs/engine.md). "
        "See docs/engines.md.",
    )
    max_batch_size: int | None = Field(
        common_default("max_batch_size"), ge=1, description=spec_description("max_batch_size")
    )
    max_num_tokens: int | None = Field(
        common_default("max_num_tokens"), ge=16, description=spec_description("max_num_tokens")
    )
    kv_cache_tokens: int | None = Field(
        common_default("kv_cache_tokens"), ge=16, description=spec_description("kv_cache_tokens")
    )
    kv_cache_memory_gb: float | None = Field(
        common_default("kv_cache_memory_gb"),
        gt=0,
        description=spec_description("kv_cache_memory_gb"),
    )
    kv_cache_memory_fraction: float = Field(
        common_default("kv_cache_memory_fraction"),
        gt=0,
        le=1,
        description=spec_description("kv_cache_memory_fraction"),
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        common_default("kv_cache_dtype"), description=spec_description("kv_cache_dtype")
    )
    enable_prefix_caching: bool = Field(
        common_default("enable_prefix_caching"),
        description=spec_description("enable_prefix_caching"),
    )
    enable_chunked_prefill: bool = Field(
        common_default("enable_chunked_prefill"),
        description=spec_description("enable_chunked_prefill"),
    )
    block_size: int = Field(
        common_default("block_size"), ge=1, description=spec_description("block_size")
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        common_default("dtype"), description=spec_description("dtype")
    )
    device: str = Field(common_default("device"), description=spec_description("device"))
    max_model_len: int | None = Field(
        common_default("max_model_len"), ge=16, description=spec_description("max_model_len")
    )
    profile_dir: str | None = Field(
        None,
        description="reference engine: record engine steps with torch.profiler and write a "
        "Chrome / Perfetto trace (JSON) to this local directory on each node, one named range "
        "per step phase (schedule, build_inputs, forward, sample, detokenize, deliver; NVTX "
        "ranges too on CUDA). Null: no profiling and no overhead. See docs/engine.md.",
    )
    profile_steps: int = Field(
        20, ge=1, description="reference engine with profile_dir: engine steps to record."
    )
    scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = Field(
        common_default("scheduler_policy"), description=spec_description("scheduler_policy")
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="with model.adapters: LoRA adapters usable in one engine step (the "
        "model's adapter slots; vLLM's and TensorRT-LLM's max_loras); rows of other adapters "
        "wait for a slot. Null: 4.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="with model.adapters: the highest adapter rank accepted (slots are sized "
        "for it; vLLM rounds its slots up to 8, 16, 32, 64, ...); an adapter above it fails "
        "its rows. Null: 64.",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="with model.adapters: adapters kept read in memory. Null: max(max_loras, 8).",
    )
    speculative: SpeculativeSpec | None = Field(
        None,
        description="Speculative decoding: {method: ngram | draft | eagle3 | mtp, num_tokens, "
        "...}. Greedy output is unchanged token for token; sampled output keeps the model's "
        "distribution. Null: off. See docs/speculative-decoding.md.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Engine-specific options passed through verbatim."
    )
    expected_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Output tokens per second one actor is expected to generate; `tokenmill "
        "plan` uses it for the time and cost estimate (or --tokens-per-s / --measure). Not "
        "passed to the engine.",
    )

    @model_validator(mode="after")
    def _synthetic_settings(self) -> EngineSpec:
        """engine.kind synthetic: its settings (in `extra`) are checked now, not at load."""
        if self.kind == "synthetic":
            shared = {"max_batch_size": self.max_batch_size, "max_model_len": self.max_model_len}
            given = {k: v for k, v in shared.items() if v is not None} | self.extra
            try:
                SyntheticSettings.of(given)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"engine.extra: {exc}") from None
        return self

    @model_validator(mode="after")
    def _speculative_runs_on_kind(self) -> EngineSpec:

        if self.speculative is not None:
            found = problems(self.kind, self.speculative.model_dump())
            if self.kind == "trtllm" and self.extra.get("backend", "pytorch") != "pytorch":
                found.append("trtllm speculates on its pytorch backend only (engine.extra.backend)")
            if found:
                raise ValueError("engine.speculative: " + "; ".join(found))
        return self
