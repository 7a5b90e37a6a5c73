"""Stand-in for `tensorrt_llm.llmapi` (TensorRT-LLM 1.2): the config objects the adapter builds.

Field names and defaults follow the 1.2 LLM API reference; unknown fields raise (the real ones
are pydantic models with extra="forbid").
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorrt_llm.sampling_params import GuidedDecodingParams  # noqa: F401  (re-exported, as in 1.2)


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class QuantAlgo(str, enum.Enum):
    FP8 = "FP8"
    NVFP4 = "NVFP4"
    W4A16_AWQ = "W4A16_AWQ"
    NO_QUANT = "NO_QUANT"


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    dtype: str = "auto"
    tokens_per_block: int = 32

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "fp8", "nvfp4"):
            raise ValueError(f"KvCacheConfig.dtype {self.dtype!r} invalid")
        if self.free_gpu_memory_fraction is not None and not 0 < self.free_gpu_memory_fraction <= 1:
            raise ValueError("free_gpu_memory_fraction must be in (0, 1]")


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: Any = None
    dynamic_batch_config: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_scheduler_policy, CapacitySchedulerPolicy):
            raise ValueError("capacity_scheduler_policy must be a CapacitySchedulerPolicy")


@dataclass
class CudaGraphConfig:
    """PyTorch backend only, as 1.2's validator does it. batch_sizes given: sorted, and
    max_batch_size becomes their maximum (a different non-zero max_batch_size is an error);
    otherwise max_batch_size defaults to 128 and the sizes up to it are generated
    (`generated_batch_sizes`). enable_padding rounds a batch up to the next captured size.
    The library's docs: each captured graph can use up to 200 MB of extra memory."""

    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    enable_padding: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError("cuda_graph_config.max_batch_size must be non-negative")
        if self.batch_sizes:
            self.batch_sizes = sorted(self.batch_sizes)
            top = self.batch_sizes[-1]
            if self.max_batch_size not in (0, top):
                raise ValueError(
                    f"cuda_graph_config.max_batch_size ({self.max_batch_size}) must equal "
                    f"max(batch_sizes) ({top})"
                )
            self.max_batch_size = top
        else:
            self.max_batch_size = self.max_batch_size or 128
            self.batch_sizes = generated_batch_sizes(self.max_batch_size, self.enable_padding)


def generated_batch_sizes(top: int, padding: bool) -> list[int]:
    """The batch sizes 1.2 captures up to `top`: with padding 1, 2, 4 and multiples of 8 up to
    128; without, every size below 32, then 32, 64, 128; both then the powers of two from 256
    below `top`, and `top` itself."""
    small = [1, 2, 4] + [8 * i for i in range(1, 17)] if padding else [*range(1, 32), 32, 64, 128]
    powers = [2**i for i in range(8, math.ceil(math.log2(top)))] if top > 1 else []
    return sorted({s for s in small + powers if s <= top} | {top})


@dataclass
class QuantConfig:
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None
    group_size: int = 128
    exclude_modules: list[str] | None = None


@dataclass
class CalibConfig:
    """calib_dataset: a dataset name (cnn_dailymail, the default, is fetched from the Hugging
    Face Hub at build time) or a local directory whose "train" split has a "text" column.
    Checked when the TensorRT backend builds (see _tensorrt_engine.load_calibration_texts)."""

    device: str = "cuda"
    calib_dataset: str = "cnn_dailymail"
    calib_batches: int = 512
    calib_batch_size: int = 1
    calib_max_seq_length: int = 512
    random_seed: int = 1234
    tokenizer_max_seq_length: int = 2048


@dataclass
class BuildConfig:
    max_input_len: int = 1024
    max_seq_len: int | None = None
    max_batch_size: int = 2048
    max_num_tokens: int = 8192
    max_beam_width: int = 1
    opt_num_tokens: int | None = None
    plugin_config: Any = field(default=None)


@dataclass
class BuildCacheConfig:
    cache_root: Path | None = None
    max_records: int = 10
    max_cache_storage_gb: float = 256


# --- speculative decoding (1.2 `llm_args`: DecodingBaseConfig and its subclasses) ---------------


@dataclass
class DecodingBaseConfig:
    """Fields every decoding config has. `speculative_model` is also accepted as
    `speculative_model_dir` in the real pydantic model (an alias)."""

    max_draft_len: int | None = None
    max_total_draft_tokens: int | None = None
    speculative_model: str | Path | None = None
    max_concurrency: int | None = None
    load_format: str | None = None
    # 1.2: off by default, and on the one-model paths (Eagle3's and MTP's defaults) a request's
    # temperature, top_p and top_k are then not applied: it decodes greedily, without an
    # error (speculative/interface.py samples with argmax unless it is set).
    allow_advanced_sampling: bool = False

    decoding_type = "Base"

    @property
    def samples_greedily(self) -> bool:
        """Whether every request decodes greedily under this config, whatever it asks."""
        return False

    def __post_init__(self) -> None:
        if self.max_draft_len is not None and self.max_draft_len < 0:
            raise ValueError("max_draft_len must be non-negative")
        if self.max_concurrency is not None and self.max_concurrency < 0:
            raise ValueError("max_concurrency must be non-negative")

    def supports_backend(self, backend: str) -> bool:
        return backend == "pytorch"


@dataclass
class NGramDecodingConfig(DecodingBaseConfig):
    max_matching_ngram_size: int = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    decoding_type = "NGram"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for NGram")
        if self.max_matching_ngram_size <= 0:
            raise ValueError("max_matching_ngram_size must be positive")
        self.max_total_draft_tokens = self.max_draft_len


@dataclass
class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type = "Draft_Target"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")
        self.max_total_draft_tokens = self.max_draft_len


@dataclass
class EagleDecodingConfig(DecodingBaseConfig):
    eagle_choices: list[list[int]] | None = None
    greedy_sampling: bool | None = True
    posterior_threshold: float | None = None
    use_dynamic_tree: bool | None = False
    dynamic_tree_max_topK: int | None = None  # the real field name
    num_eagle_layers: int | None = None
    max_non_leaves_per_layer: int | None = None
    eagle3_one_model: bool | None = True
    eagle3_layers_to_capture: set[int] | None = None

    decoding_type = "Eagle"

    @property
    def samples_greedily(self) -> bool:
        return bool(self.eagle3_one_model) and not self.allow_advanced_sampling

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for Eagle")
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")
        self.num_eagle_layers = self.max_draft_len
        self.max_total_draft_tokens = self.max_draft_len


@dataclass
class Eagle3DecodingConfig(EagleDecodingConfig):
    decoding_type = "Eagle3"


@dataclass
class MTPDecodingConfig(DecodingBaseConfig):
    num_nextn_predict_layers: int = 1
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    use_mtp_vanilla: bool = False
    mtp_eagle_one_model: bool = True

    decoding_type = "MTP"

    @property
    def samples_greedily(self) -> bool:
        return self.mtp_eagle_one_model and not self.allow_advanced_sampling

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_nextn_predict_layers <= 0:
            raise ValueError("num_nextn_predict_layers must be positive")
        self.max_draft_len = self.num_nextn_predict_layers
        self.max_total_draft_tokens = self.num_nextn_predict_layers
