"""Build tiny Hugging Face checkpoints locally: a byte-level BPE tokenizer trained on built-in
text and a small random Llama / Qwen2 / Qwen3 / Qwen3-MoE / GPT-OSS / Qwen2.5-VL model, saved as a
normal HF directory (GPT-OSS optionally with MXFP4-packed experts, as the released checkpoints;
Qwen2.5-VL with its image processor, so prompts with images render and process offline).

Nothing can be downloaded where tokenmill is built and tested, so tests, the demo and the
benchmarks all run on models made here. Weights are random but drawn with a wide init so that
greedy decoding produces varied tokens instead of one token repeated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engines.quantize.calibration import sample_text

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "qwen2_5_vl"]
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "qwen2_5_vl")

# Qwen2.5-VL's image markers, and a chat template that renders OpenAI content parts as Qwen's
# does: an image part becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor
# expands to one <|image_pad|> per image token.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tiny processor's pixel budget: images are resized to between 4 and 64 merged tokens
# (28x28 pixels each), so tests see several sizes and the windows (56 pixels) matter.
VISION_MIN_PIXELS = 4 * 28 * 28
VISION_MAX_PIXELS = 64 * 28 * 28


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Reasoning variants (make_tiny_model(reasoning=...)), for tests of reasoning output:
# `think` adds <think> and </think> as plain added tokens (they decode to themselves, as in
# Qwen3) and a Qwen3-style template that opens the block in the prompt unless
# enable_thinking is false, when it writes an empty closed block instead; `harmony` adds
# GPT-OSS's message markers as special tokens and a harmony template. Both templates write
# `Reasoning: <effort>` into a system turn when reasoning_effort is given.
Reasoning = Literal["none", "think", "harmony"]
THINK_TOKENS = ("<think>", "</think>")
HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
_EFFORT_TURN = (
    "{% if reasoning_effort is defined and reasoning_effort %}"
    "<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
)
THINK_CHAT_TEMPLATE = (
    _EFFORT_TURN + "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# Tools as GPT-OSS's template renders them, in short: a developer message declaring the
# functions, an assistant call as a message to `functions.NAME` ending in <|call|>, and its
# result as a message from that function.
HARMONY_CHAT_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' }}"
    "<|end|>"
    "{% if tools is defined and tools %}<|start|>developer<|message|># Tools\n"
    "namespace functions {\n{% for tool in tools %}"
    "type {{ tool['function']['name'] }} = (_: any) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.tool_calls is defined "
    "and message.tool_calls %}{% for call in message.tool_calls %}"
    "<|start|>assistant to=functions.{{ call['function']['name'] }}<|channel|>commentary "
    "json<|message|>{{ call['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% elif message['role'] == 'tool' %}"
    "<|start|>functions to=assistant<|channel|>commentary<|message|>"
    "{{ message['content'] }}<|end|>"
    "{% else %}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSize:
    """Shape of a generated model. `tiny` is for unit tests, `tiny-hd32` for tests that run
    vLLM too, `small` (~35M) for benchmarks, `1b` for GPU checks."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int


SIZES: dict[str, TinyModelSize] = {
    "tiny": TinyModelSize(64, 176, 2, 4, 2, 1024, 2048),
    # tiny with head_dim 32: vLLM's CPU attention kernels take head sizes from 32 up.
    "tiny-hd32": TinyModelSize(128, 352, 2, 4, 2, 1024, 2048),
    "small": TinyModelSize(512, 1408, 8, 8, 2, 8192, 4096),
    # ~1.1B parameters (Llama-3.2-1B's width), for the GPU device check: big enough that the
    # engines, not Python, bound a step.
    "1b": TinyModelSize(2048, 5632, 22, 32, 4, 32000, 4096),
}


def moe_fields(shape: TinyModelSize) -> dict[str, Any]:
    """Qwen3-MoE's expert settings for a shape: 8 experts, top-2 renormalised as the released
    Qwen3-MoE checkpoints do, each expert about a quarter of the dense MLP's width, every
    layer sparse (mlp_only_layers / decoder_sparse_step can be set through config_overrides).
    The width is a multiple of 16: transformers' bf16 grouped expert matmul on CPU refuses
    rows that are not a multiple of 16 bytes."""
    return dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=max(16, shape.intermediate_size // 64 * 16),
        norm_topk_prob=True,
    )


# GPT-OSS's window in the tiny models: far shorter than the test prompts (up to ~80 tokens), so
# the sliding layers' masks matter.
GPT_OSS_TINY_WINDOW = 8


def gpt_oss_fields(shape: TinyModelSize) -> dict[str, Any]:
    """GPT-OSS's settings for a shape: 8 experts of the dense MLP's width rounded down to a
    multiple of 32 (MXFP4 packs 32 columns per scale), top-2, sliding and full layers
    alternating, and YaRN over a short original context so the scaling changes the
    frequencies the tests run at (as gpt-oss-20b's: factor 32, beta 32 / 1, no truncation)."""
    return dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=max(32, shape.intermediate_size // 2 // 32 * 32),
        head_dim=shape.hidden_size // shape.num_attention_heads,
        sliding_window=GPT_OSS_TINY_WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": shape.max_position_embeddings // 32,
        },
    )


def shape_fields(shape: TinyModelSize) -> dict[str, int]:
    """The transformers config fields a shape sets (vocab aside: the tokenizer decides it)."""
    return dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
    )


def train_tokenizer(vocab_size: int, seed: int = 0, reasoning: Reasoning = "none"):
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast) with chat template and specials;
    `reasoning` adds a reasoning format's tokens and template (see THINK_CHAT_TEMPLATE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_text(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    if reasoning == "think":
        fast.add_tokens(list(THINK_TOKENS))  # not special: they stay in decoded text
        fast.chat_template = THINK_CHAT_TEMPLATE
    elif reasoning == "harmony":
        fast.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
        fast.eos_token = "<|return|>"
        fast.chat_template = HARMONY_CHAT_TEMPLATE
    elif reasoning != "none":
        raise ValueError(f"unknown reasoning {reasoning!r}; choose none, think or harmony")
    return fast


def make_tiny_model(
    out_dir: str | Path,
    arch: Arch = "llama",
    size: str = "tiny",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    initializer_range: float = 0.2,
    torch_dtype: str = "float32",
    config_overrides: dict[str, Any] | None = None,
    reasoning: Reasoning = "none",
    mxfp4: bool = False,
) -> Path:
    """Write a random `arch` model of preset `size` and its tokenizer to `out_dir`.

    `reasoning` (think | harmony) gives the tokenizer a reasoning format's tokens and chat
    template (see THINK_CHAT_TEMPLATE); the default leaves the tokenizer as it always was.

    `config_overrides` are extra transformers config fields (e.g. attention_bias=True,
    mlp_bias=True) for tests of config variants whose weights differ in shape or count.
    `mxfp4` (gpt_oss only) stores the expert weights MXFP4-packed (`*_blocks` / `*_scales`,
    `quantization_config` in config.json), as the released GPT-OSS checkpoints do."""
    import torch
    import transformers

    if reasoning not in ("none", "think", "harmony"):
        raise ValueError(f"unknown reasoning {reasoning!r}; choose none, think or harmony")
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if mxfp4 and arch != "gpt_oss":
        raise ValueError("mxfp4 packing is for arch gpt_oss only")
    shape = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(shape.vocab_size, seed, reasoning)
    if arch == "qwen2_5_vl":
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        tokenizer.chat_template = VISION_CHAT_TEMPLATE
    # The trained vocab can come out a little smaller than asked; the model must cover it.
    vocab_size = max(shape.vocab_size, len(tokenizer))
    common = dict(
        vocab_size=vocab_size,
        **shape_fields(shape),
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        **(config_overrides or {}),
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(
            **common, rope_theta=1000000.0, head_dim=shape.hidden_size // shape.num_attention_heads
        )
        model_cls = transformers.Qwen3ForCausalLM
    elif arch == "gpt_oss":
        fields = {**common, **gpt_oss_fields(shape)}
        fields.update(config_overrides or {})
        config = transformers.GptOssConfig(**fields)
        model_cls = transformers.GptOssForCausalLM
    elif arch == "qwen2_5_vl":
        config = _vision_language_config(common, tokenizer, shape)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        config = transformers.Qwen3MoeConfig(
            **{**moe_fields(shape), **common},
            rope_theta=1000000.0,
            head_dim=shape.hidden_size // shape.num_attention_heads,
        )
        model_cls = transformers.Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Random norms and biases (defaults are ones and zeros) so that loaders which forget
        # a norm weight or a bias give visibly different outputs in the equality tests.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_bias")):
                param.normal_(0.0, initializer_range)
            elif name.endswith(".sinks"):  # GPT-OSS: large enough to take a visible share
                param.normal_(0.0, 1.0)
    model = model.to(getattr(torch, torch_dtype))
    model.save_pretrained(out, safe_serialization=True)
    if mxfp4:
        _pack_experts_mxfp4(out)
    tokenizer.save_pretrained(out)
    if arch == "qwen2_5_vl":
        _image_processor().save_pretrained(out)
    (out / "tokenmill_tiny.json").write_text(
        json.dumps({"arch": arch, "size": size, "seed": seed, "tied": tie_word_embeddings})
    )
    return out


def _vision_language_config(common: dict[str, Any], tokenizer: Any, shape: TinyModelSize):
    """A Qwen2.5-VL config: the shape's Qwen2 decoder with mrope, behind a two-block vision
    encoder (one windowed block, one over the whole image) that merges 2x2 patches."""
    import transformers

    pairs = shape.hidden_size // shape.num_attention_heads // 2  # rotary pairs per head
    time = pairs // 4  # a quarter for the frame, the rest split between rows and columns
    section = [time, (pairs - time) // 2, pairs - time - (pairs - time) // 2]
    # rope_scaling + rope_theta: the spelling transformers 4.5x reads and 5 still converts.
    text = {
        **common,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": section},
    }
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
        )
    }
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=shape.hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        initializer_range=common["initializer_range"],
    )
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        eos_token_id=common["eos_token_id"],
        pad_token_id=common["pad_token_id"],
        tie_word_embeddings=common["tie_word_embeddings"],
        initializer_range=common["initializer_range"],
        **ids,
    )


def _image_processor():
    """Qwen2.5-VL's image processor (`preprocessor_config.json`) with a small pixel budget.
    The tokenizer beside it carries the chat template; the prompt stage expands each image's
    placeholder itself, so no video processor (torchvision) is needed."""
    import transformers

    # transformers 5 names the PIL backend apart; 4.5x's Qwen2VLImageProcessor is that one.
    kind = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
    return kind(min_pixels=VISION_MIN_PIXELS, max_pixels=VISION_MAX_PIXELS)


def _pack_experts_mxfp4(model_dir: Path) -> None:
    """Rewrite a saved GPT-OSS checkpoint with MXFP4 experts: `gate_up_proj` [E, H, 2I] and
    `down_proj` [E, I, H] become `*_blocks` / `*_scales` of their transposes (rows are output
    features, see engines.reference.model.mxfp4), biases unchanged; config.json gains the
    `quantization_config` transformers reads such checkpoints with."""
    from safetensors.torch import load_file, save_file

    # torch: only MXFP4 checkpoints need it
    from engines.reference.model import mxfp4

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    config_path.write_text(json.dumps(config, indent=2))


def make_truncated_model(source_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write a copy of the model in `source_dir` that keeps only its first `num_layers` decoder
    layers (embeddings, final norm, LM head and tokenizer unchanged) to `out_dir`.

    A draft model for speculative decoding tests and benchmarks: it shares the target's
    tokenizer and vocabulary, costs num_layers / L of its layers, and, being the target minus
    its top layers, agrees with it often enough for acceptance to be measurable (a separately
    drawn random model almost never agrees with another)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(source_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be 1..{config['num_hidden_layers']}, got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    kept = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            continue
        kept[name] = tensor
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # newer transformers: one entry per layer
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, out / path.name)
    return out
