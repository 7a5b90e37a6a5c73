"""A tiny Llama trained to copy: the model for benchmarking prompt-lookup speculation.

engines.dev.tiny's random models do not copy their prompt; their greedy output only sometimes
repeats it, which caps what n-gram speculation can gain on them. This module trains one that
does: sequences `passage SEP passage` of random token ids, the loss on the copy only, so the
model learns to continue `passage SEP` with the passage (induction heads: one head attends to
the previous token, a later one to the token after the earlier occurrence of the current one).
Plain PyTorch on CPU, a few minutes; the result is a normal Hugging Face checkpoint (weights,
config, engines.dev.tiny's tokenizer) cached under ~/.cache/tokenmill/bench/ by its settings.

`ensure_copy_model` is the entry point: it trains (or reuses the cache), measures how well the
model copies held-out passages greedily, and raises CopyTrainingFailed when it does not copy,
since a benchmark on a model that does not copy measures nothing about copying.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.dev.tiny import SIZES, SPECIAL_TOKENS, shape_fields, train_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

# The separator between a passage and its copy: a special token, so no passage contains it.
SEP_TOKEN = "<|im_start|>"
# Passage tokens are drawn from the ids after the specials (0..2 in engines.dev.tiny's tokenizer).
FIRST_PASSAGE_ID = len(SPECIAL_TOKENS)
# Held-out passages come from a seed stream far from the training one.
HELD_OUT_SEED = 1_000_003
DEFAULT_CACHE = Path.home() / ".cache" / "tokenmill" / "bench"
REPORT_FILE = "tokenmill_copy.json"


class CopyTrainingFailed(RuntimeError):
    """The trained model does not copy well enough to benchmark copying with."""


@dataclass(frozen=True)
class CopyTraining:
    """Everything that decides the trained weights (the cache key) plus the bar they must clear.

    Passage lengths are drawn per batch, uniformly from a quarter of a cap (at least
    `passage_len[0]`) to the cap. The cap is `short_len` until `ramp[0]`, then grows linearly to
    `passage_len[1]` at `ramp[1]`: on short passages the model leaves its plateau (loss
    ~ln(vocab) for ~900 steps, then the induction circuit forms within ~100) sooner than on long
    ones, and it does not copy past the longest length it was trained on (at 64 tokens, trained
    to 48: ~1% right). Lengths near the longest need most of the steps after the ramp: with
    lengths drawn from the whole range instead, the loss fell to 0.005 and yet 5 of 16
    held-out 256-token passages went wrong somewhere (often their first token, the one that
    needs attention all the way back to the start, or a token that occurs twice)."""

    size: str = "tiny-hd32"
    passage_len: tuple[int, int] = (8, 256)
    short_len: int = 48
    ramp: tuple[int, int] = (1000, 2000)
    steps: int = 3200
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2
    # Share of greedy tokens equal to the passage, on held-out passages, required to pass.
    min_copy_share: float = 0.95

    def key(self) -> str:
        """A short stable hash of the settings that shape the weights (not `threads`, which
        only changes speed, nor the pass bar)."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("threads", "min_copy_share")}
        blob = json.dumps(settings, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True)
class CopyReport:
    """How training went and how well the result copies."""

    train_seconds: float
    first_loss: float
    final_loss: float
    copy_share: float  # greedy tokens equal to the passage / tokens generated, held out
    exact_copies: int  # held-out passages copied without a single wrong token
    num_eval: int
    eval_len: int


def passage(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(FIRST_PASSAGE_ID, vocab_size) for _ in range(length)]


def copy_prompts(
    count: int, vocab_size: int, sep_id: int, length: int, seed: int = HELD_OUT_SEED
) -> list[list[int]]:
    """`count` prompts `passage SEP`, passages of `length` distinct random ids: the model's
    greedy continuation of each is its passage.

    Distinct, unlike the training passages: where a token occurs twice, what follows it is
    decided by the token before it, which two layers trained for minutes sometimes get wrong
    (3 of 32 held-out 256-token passages with repeats derailed there; 0 of 48 without)."""
    rng = random.Random(seed)
    ids = range(FIRST_PASSAGE_ID, vocab_size)
    return [[*rng.sample(ids, length), sep_id] for _ in range(count)]


def copy_batch(
    rng: random.Random, vocab_size: int, sep_id: int, batch_size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids `passage SEP passage` and labels that score only the copy (the first half
    cannot be predicted, and learning it would only teach the unigram distribution)."""
    import torch

    rows = []
    for _ in range(batch_size):
        text = passage(rng, vocab_size, length)
        rows.append([*text, sep_id, *text])
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, : length + 1] = -100
    return ids, labels


def build_model(config: CopyTraining, vocab_size: int, eos_id: int, pad_id: int):
    """A fresh Llama of engines.dev.tiny's `config.size` shape (default init)."""
    import torch
    import transformers

    shape = SIZES[config.size]
    llama = transformers.LlamaConfig(
        vocab_size=vocab_size,
        **shape_fields(shape),
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    torch.manual_seed(config.seed)
    return transformers.LlamaForCausalLM(llama)


def passage_cap(step: int, config: CopyTraining) -> int:
    """The longest passage length drawn at `step` (see CopyTraining)."""
    start, end = config.ramp
    grown = min(1.0, max(0.0, (step - start) / max(1, end - start)))
    return round(config.short_len + grown * (config.passage_len[1] - config.short_len))


def lr_at(step: int, config: CopyTraining) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def train(
    model: LlamaForCausalLM,
    config: CopyTraining,
    sep_id: int,
    steps: int | None = None,
    log_every: int = 0,
) -> list[float]:
    """Train `model` in place on the copy task for `steps` (default config.steps) steps;
    returns the loss of every step."""
    import torch

    torch.set_num_threads(config.threads)
    rng = random.Random(config.seed)
    vocab = model.config.vocab_size
    optim = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    losses = []
    for step in range(config.steps if steps is None else steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, config)
        cap = passage_cap(step, config)
        length = rng.randint(max(config.passage_len[0], cap // 4), cap)
        ids, labels = copy_batch(rng, vocab, sep_id, config.batch_size, length)
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            print(f"  step {step + 1}: loss {sum(recent) / len(recent):.4f}", flush=True)
    model.eval()
    return losses


def copy_share(model: LlamaForCausalLM, sep_id: int, count: int, length: int) -> tuple[float, int]:
    """Greedy-decode `count` held-out `passage SEP` prompts for `length` tokens; returns the
    share of generated tokens equal to the passage and the number of exact copies."""
    import torch

    prompts = copy_prompts(count, model.config.vocab_size, sep_id, length)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=length,
            min_new_tokens=length,
            do_sample=False,
        )
    generated = out[:, ids.shape[1] :]
    expected = ids[:, :length]
    equal = generated == expected
    return equal.float().mean().item(), int(equal.all(dim=1).sum().item())


def train_copy_model(
    out_dir: str | Path,
    config: CopyTraining,
    eval_count: int = 16,
    eval_len: int | None = None,
    log_every: int = 100,
) -> CopyReport:
    """Train a copier, save it with its tokenizer and report to `out_dir`, and report how well
    it copies held-out passages of `eval_len` (default: the longest trained) tokens."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(SIZES[config.size].vocab_size, config.seed)
    vocab_size = max(SIZES[config.size].vocab_size, len(tokenizer))
    sep_id = tokenizer.convert_tokens_to_ids(SEP_TOKEN)
    model = build_model(config, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    started = time.monotonic()
    losses = train(model, config, sep_id, log_every=log_every)
    seconds = time.monotonic() - started
    eval_len = eval_len or config.passage_len[1]
    share, exact = copy_share(model, sep_id, eval_count, eval_len)
    report = CopyReport(
        train_seconds=seconds,
        first_loss=losses[0],
        final_loss=sum(losses[-20:]) / len(losses[-20:]),
        copy_share=share,
        exact_copies=exact,
        num_eval=eval_count,
        eval_len=eval_len,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / REPORT_FILE).write_text(
        json.dumps({"training": asdict(config), "report": asdict(report), "sep_id": sep_id})
    )
    return report


def load_report(model_dir: str | Path) -> tuple[CopyReport, int]:
    """The report saved with a trained copier, and its separator id."""
    saved: dict[str, Any] = json.loads((Path(model_dir) / REPORT_FILE).read_text())
    return CopyReport(**saved["report"]), saved["sep_id"]


def ensure_copy_model(
    config: CopyTraining | None = None, cache_dir: str | Path = DEFAULT_CACHE
) -> tuple[Path, CopyReport, int]:
    """The cached copier for `config` (trained first when there is none): its directory, its
    report and its separator id. Raises CopyTrainingFailed when it copies below the bar."""
    config = config or CopyTraining()
    out = Path(cache_dir) / f"copy-{config.size}-{config.key()}"
    if not (out / REPORT_FILE).exists():
        print(f"training the copy model into {out} ({config.steps} steps) ...", flush=True)
        train_copy_model(out, config)
    report, sep_id = load_report(out)
    if report.copy_share < config.min_copy_share:
        raise CopyTrainingFailed(
            f"the model in {out} copies {report.copy_share:.1%} of held-out tokens (needs "
            f"{config.min_copy_share:.0%}; final loss {report.final_loss:.3f}): train longer "
            "or with other settings, and delete that directory"
        )
    return out, report, sep_id
