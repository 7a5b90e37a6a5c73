"""Embeddings: which pooling a checkpoint asks for, and pooling final hidden states.

The default is read once per model: a sentence-transformers checkpoint says how it pools in
`modules.json` (a Pooling module, and a Normalize module when its embeddings are unit
length); anything else gets last-token pooling with L2 normalisation, vLLM's default for
decoder-only models (a causal model's last position is the only one that saw the whole
prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.api import EmbedParams, EngineError, Pooling

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json flags this engine can honour, and the pooling each means.
_MODES: dict[str, Pooling] = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class EmbedDefaults:
    """The model's own pooling and normalisation (what a request's None fields take)."""

    pooling: Pooling = "last"
    normalize: bool = True
    source: str = "default (last token, L2-normalised)"  # where they came from, for logs

    def resolve(self, params: EmbedParams) -> tuple[Pooling, bool]:
        pooling = params.pooling if params.pooling is not None else self.pooling
        normalize = params.normalize if params.normalize is not None else self.normalize
        return pooling, normalize


def embed_defaults(model_dir: str | Path) -> EmbedDefaults:
    """The checkpoint's sentence-transformers pooling, or last-token + normalise without one.
    A Pooling module in a mode this engine lacks (CLS, max, weighted mean) is an error, so an
    embedding is never silently pooled another way than the model was trained for."""
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.exists():
        return EmbedDefaults()
    try:
        modules = json.loads(modules_path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{modules_path} is not valid JSON: {exc}") from None
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    normalize = _NORMALIZE_MODULE in types
    pooling_module = types.get(_POOLING_MODULE)
    if pooling_module is None:
        return EmbedDefaults("last", normalize, f"{modules_path} (no Pooling module: last token)")
    config_path = Path(model_dir) / str(pooling_module.get("path", "1_Pooling")) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"{config_path}: cannot read the pooling config: {exc}") from None
    chosen = [mode for flag, mode in _MODES.items() if config.get(flag)]
    others = [
        k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _MODES
    ]
    if others or len(chosen) != 1:
        raise EngineError(
            f"{config_path} asks for pooling {', '.join(others + list(chosen)) or 'none'}; "
            "the reference engine pools by exactly one of: last token, mean"
        )
    return EmbedDefaults(chosen[0], normalize, str(config_path))


def pool(
    hidden: torch.Tensor,  # [T, hidden] final-normed states of the prompts, back to back
    lengths: list[int],  # tokens of each prompt, in order (sum = T)
    poolings: list[Pooling],
    normalize: list[bool],
) -> torch.Tensor:  # [N, hidden] float32
    """One embedding per prompt, pooled in float32 whatever the compute dtype."""
    out = []
    start = 0
    for n, how, norm in zip(lengths, poolings, normalize, strict=True):
        states = hidden[start : start + n].float()  # [n, hidden]
        vec = states[-1] if how == "last" else states.mean(dim=0)  # [hidden]
        if norm:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
        out.append(vec)
        start += n
    return torch.stack(out)
