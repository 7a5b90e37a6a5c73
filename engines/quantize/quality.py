"""The quality gate: how far a quantized model's next-token predictions drift from the original.

On held-out texts (never calibration texts) both models are run the same way and compared:
- token agreement: with teacher forcing on the text, the fraction of positions where both
  models' most likely next token is the same;
- mean KL: KL(original || quantized) of the next-token distributions, averaged over positions;
- greedy match: from each text's first tokens, both generate greedily (EOS ignored); the number
  of tokens produced before the first difference, averaged over texts.
Weight error alone says little: what matters is whether the answers change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engines.quantize.config import QualityThresholds


@dataclass
class ModelRun:
    """What one model produced on the held-out texts."""

    logprobs: list[Any]  # per text: torch float32 [T, V] log-softmax of next-token logits
    greedy: list[list[int]]  # per text: greedy continuation of its prompt prefix


@dataclass(frozen=True)
class GreedySample:
    """A prompt and the quantized model's greedy tokens: a loader of the export must match."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class QualityReport:
    format: str  # fp8 | nvfp4 (+ kv cache below)
    kv_cache: str | None
    num_prompts: int  # held-out texts compared
    num_positions: int  # teacher-forced positions compared, all texts
    token_agreement: float  # fraction of positions with the same argmax
    mean_kl: float  # nats, mean over positions
    max_kl: float  # nats, worst position
    greedy_match_mean: float  # mean tokens before the first greedy divergence
    greedy_full_match_fraction: float  # texts whose whole greedy continuation matched
    greedy_tokens: int  # tokens generated per text
    thresholds: QualityThresholds
    passed: bool
    failures: list[str]  # one line per threshold missed
    quality_failure_allowed: bool = False  # published despite failures (explicit override)
    samples: list[GreedySample] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["thresholds"] = self.thresholds.model_dump()
        return data

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"quality gate {verdict}: token agreement {self.token_agreement:.3f} "
            f"(min {self.thresholds.min_token_agreement}), mean KL {self.mean_kl:.4f} "
            f"(max {self.thresholds.max_mean_kl}), greedy match {self.greedy_match_mean:.1f}/"
            f"{self.greedy_tokens} tokens (min {self.thresholds.min_greedy_match})"
        )


def run_model(model: Any, texts_ids: list[list[int]], prompt_len: int, greedy_tokens: int):
    """Teacher-forced log-probs on each text and a greedy continuation of its first tokens."""
    import torch

    logprobs, greedy = [], []
    device = next(model.parameters()).device
    with torch.no_grad():
        for ids in texts_ids:
            input_ids = torch.tensor([ids], device=device)  # [1, T]
            logits = model(input_ids=input_ids, use_cache=False).logits[0]  # [T, V]
            logprobs.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            greedy.append(greedy_generate(model, ids[:prompt_len], greedy_tokens))
    return ModelRun(logprobs=logprobs, greedy=greedy)


def greedy_generate(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with the model's KV cache; EOS does not stop it (fixed length)."""
    import torch

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        next_id = out.logits[0, -1].argmax()  # scalar
        tokens.append(int(next_id))
        if len(tokens) == num_tokens:
            break
        out = model(
            input_ids=next_id.view(1, 1), past_key_values=out.past_key_values, use_cache=True
        )
    return tokens


def matched_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading positions where a and b agree."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(
    original: ModelRun,
    quantized: ModelRun,
    thresholds: QualityThresholds,
    *,
    format: str,
    kv_cache: str | None,
    prompts: list[list[int]],
) -> QualityReport:
    """Score the quantized run against the original and apply the thresholds."""
    agree = positions = 0
    kl_sum, kl_max = 0.0, 0.0
    for p, q in zip(original.logprobs, quantized.logprobs, strict=True):
        # p, q: [T, V] log-probs over the same token positions.
        kl = (p.exp() * (p - q)).sum(dim=-1).clamp(min=0)  # [T]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        positions += p.shape[0]
    matches = [matched_prefix(a, b) for a, b in zip(original.greedy, quantized.greedy, strict=True)]
    greedy_len = max((len(g) for g in original.greedy), default=0)
    token_agreement = agree / max(positions, 1)
    mean_kl = kl_sum / max(positions, 1)
    greedy_match = sum(matches) / max(len(matches), 1)
    failures = []
    if token_agreement < thresholds.min_token_agreement:
        failures.append(
            f"token agreement {token_agreement:.3f} < min_token_agreement "
            f"{thresholds.min_token_agreement}"
        )
    if not mean_kl <= thresholds.max_mean_kl:  # `not <=` also catches NaN
        failures.append(f"mean KL {mean_kl:.4f} > max_mean_kl {thresholds.max_mean_kl}")
    if greedy_match < thresholds.min_greedy_match:
        failures.append(
            f"greedy match {greedy_match:.2f} tokens < min_greedy_match "
            f"{thresholds.min_greedy_match}"
        )
    return QualityReport(
        format=format,
        kv_cache=kv_cache,
        num_prompts=len(matches),
        num_positions=positions,
        token_agreement=token_agreement,
        mean_kl=mean_kl,
        max_kl=kl_max,
        greedy_match_mean=greedy_match,
        greedy_full_match_fraction=sum(m == greedy_len for m in matches) / max(len(matches), 1),
        greedy_tokens=greedy_len,
        thresholds=thresholds,
        passed=not failures,
        failures=failures,
        samples=[
            GreedySample(prompt_token_ids=list(p), output_token_ids=list(g))
            for p, g in zip(prompts, quantized.greedy, strict=True)
        ],
    )
