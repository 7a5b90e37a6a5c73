"""Speculative decoding in the reference engine (n-gram or draft model), on and off, side by
side in one run.

    .venv/bin/python tests/benchmarks/bench_speculative.py [--method ngram|draft]
        [--model random|copy-trained] [--size tiny|small] [--batches 1,8,64]
        [--max-tokens 128] [--num-tokens 4] [--draft-layers 1] [--top-scale 0.03]
        [--threads 2] [--repeat 2]

Workloads, greedy:
- `--model random` (default): prompts that repeat a random span of the tiny tokenizer's
  vocabulary 2-5 times, on a tiny random model (`--size`) with a narrow init
  (initializer_range 0.05), whose greedy output falls into repeats of itself. A random model
  does not copy its prompt; its own repeats stand in for that, only partly: at batch 1 most
  steps find no earlier occurrence of the last tokens and propose nothing (the partial case).
- `--model copy-trained` (ngram only): a tiny Llama (engines.dev.tiny's `tiny-hd32` shape)
  trained for a few minutes to copy (engines.dev.tiny_copy; cached under
  ~/.cache/tokenmill/bench/, trained on first use), prompts `passage SEP` of held-out random
  passages of --max-tokens ids, whose greedy continuation is the passage: the best case for
  prompt lookup, every step after the first can propose. The share of generated tokens equal
  to the passage is printed per batch size ("copied").

For each batch size (all requests submitted at once, ignore_eos, exactly --max-tokens tokens
each) the engine runs without speculation, then with `ngram` and speculation forced on at every
batch size, then with the engine's default `disable_above_batch_size`.

--method draft: the draft is a smaller model with the target's tokenizer, the target's first
--draft-layers decoder layers (engines.dev.tiny.make_truncated_model: same embeddings and head).
A cut of a random model almost never agrees with it (~1% on `small`), so the target here is
the random model with the output projections (o_proj, down_proj) of its layers past the
draft's scaled by --top-scale: those layers then refine what the first ones say, and the draft
agrees at a rate like a real small model's (0.03: ~70% on `small`; 1.0: the plain model).
Variants: off, that draft with speculation always on and with the default switch, and the
target as its own draft (always on; acceptance ~1: what is left of the gain when the k draft
forwards cost as much as the target's). What it measures: the draft's k forwards plus the
k + 1 verified positions against the target steps the accepted proposals save, at a known
acceptance rate; not the acceptance a trained draft would reach on real text. Printed per
run: output
tokens/s over the generation window (first submission to last finish, model load excluded),
speed-up against no speculation, acceptance rate (accepted / proposed), and mean tokens
emitted per verification (1 + accepted per request-step that verified proposals). The
fastest of --repeat runs counts, so a burst of load elsewhere on the machine does not decide
(the repeats go round the variants in turn, so such a burst hits them alike); one warm-up run
goes first. Greedy ids are checked equal across the variants.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# A workload: the prompts of one run at a batch size.
Workload = Callable[[int], list[list[int]]]


def build_model(size: str) -> Path:
    from engines.dev.tiny import make_tiny_model

    out = Path(tempfile.gettempdir()) / f"tokenmill-bench-spec-{size}"
    if not (out / "config.json").exists():
        make_tiny_model(out, size=size, initializer_range=0.05)
    return out


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
        out.append(span * rng.randint(2, 5))
    return out


def copy_workload(max_tokens: int) -> tuple[Path, Workload]:
    """The trained copier and its held-out `passage SEP` prompts (passages of `max_tokens`)."""
    from engines.dev.tiny_copy import CopyTraining, copy_prompts, ensure_copy_model

    training = CopyTraining()
    if max_tokens > training.passage_len[1]:
        raise SystemExit(
            f"--max-tokens {max_tokens}: the copy model is trained on passages of up to "
            f"{training.passage_len[1]} tokens and does not copy longer ones"
        )
    model, report, sep_id = ensure_copy_model(training)
    print(
        f"copy model {model.name}: trained {report.train_seconds:.0f} s, final loss "
        f"{report.final_loss:.3f}; greedy copies {report.copy_share:.1%} of held-out tokens "
        f"({report.exact_copies}/{report.num_eval} passages of {report.eval_len} exact)"
    )
    vocab = vocab_size(model)
    return model, lambda count: copy_prompts(count, vocab, sep_id, max_tokens)


def random_workload(model: Path) -> Workload:
    vocab = vocab_size(model)
    return lambda count: prompts(count, vocab)


def vocab_size(model: Path) -> int:
    import json

    return json.loads((model / "config.json").read_text())["vocab_size"]


def copied_share(prompt_ids: list[list[int]], outputs: list[list[int]]) -> float:
    """Share of output tokens equal to the token at the same place in the prompt's passage
    (the prompt minus its trailing separator)."""
    same = sum(
        sum(a == b for a, b in zip(out, prompt[:-1], strict=False))
        for prompt, out in zip(prompt_ids, outputs, strict=True)
    )
    return same / max(1, sum(len(out) for out in outputs))


def damp_top_layers(model: Path, num_layers: int, scale: float) -> Path:
    """A copy of `model` whose layers from `num_layers` on write `scale` times as much into
    the residual stream (their o_proj and down_proj weights scaled)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = model.parent / f"{model.name}-top{scale:g}-from{num_layers}"
    if (out / "config.json").exists():
        return out
    shutil.copytree(model, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, tensor in tensors.items():
        parts = name.split(".")
        is_top = parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers
        if is_top and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensor * scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_draft(model: Path, num_layers: int) -> Path:
    from engines.dev.tiny import make_truncated_model

    out = model.parent / f"{model.name}-draft-{num_layers}layer"
    if not (out / "config.json").exists():
        make_truncated_model(model, out, num_layers)
    return out


def run_once(
    model: Path, prompt_ids: list[list[int]], args: argparse.Namespace, speculative: dict | None
):
    from engines.api import GenerationRequest, SamplingParams
    from engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(
        str(model),
        num_threads=args.threads,
        max_batch_size=max(len(prompt_ids), 1),
        speculative=speculative,
    )
    reqs = [
        GenerationRequest(
            p,
            SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
            request_id=f"r{i}",
        )
        for i, p in enumerate(prompt_ids)
    ]

    async def main():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    try:
        started = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - started
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    tokens = sum(r.completion_tokens for r in results)
    proposed = sum(r.spec_proposed_tokens for r in results)
    accepted = sum(r.spec_accepted_tokens for r in results)
    verifications = sum(len(rec.spec_proposed_tokens) for rec in records)
    return {
        "tokens_per_s": tokens / elapsed,
        "ids": [r.output_token_ids for r in results],
        "acceptance": accepted / proposed if proposed else None,
        "per_verification": (1 + accepted / verifications) if verifications else None,
        "steps": len(records),
    }


def best_of_each(model, prompt_ids, args, variants):
    """The fastest of --repeat runs of every variant. Repeats go round the variants in turn, so
    a burst of load elsewhere on the machine hits them alike, not all runs of one."""
    runs: list[list[dict]] = [[] for _ in variants]
    for _ in range(args.repeat):
        for mine, (_, speculative) in zip(runs, variants, strict=True):
            mine.append(run_once(model, prompt_ids, args, speculative))
    return [max(mine, key=lambda r: r["tokens_per_s"]) for mine in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    parser.add_argument("--model", default="random", choices=["random", "copy-trained"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--top-scale", type=float, default=0.03)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from engines.reference.engine import DEFAULT_DISABLE_ABOVE_BATCH_SIZE

    if args.model == "copy-trained":
        if args.method != "ngram":
            parser.error("--model copy-trained is for --method ngram (a cut of it does not copy)")
        model, workload = copy_workload(args.max_tokens)
    else:
        model = build_model(args.size)
        if args.method == "draft" and args.top_scale != 1.0:
            model = damp_top_layers(model, args.draft_layers, args.top_scale)
        workload = random_workload(model)
    # Warm-up: first-call costs must not land on one variant.
    run_once(model, workload(4), args, None)
    always = {"disable_above_batch_size": 1 << 20}
    default = f"default (off above {DEFAULT_DISABLE_ABOVE_BATCH_SIZE})"
    if args.method == "ngram":
        ngram = {"method": "ngram", "num_tokens": args.num_tokens}
        variants = [
            ("off", None),
            ("ngram, always on", {**ngram, **always}),
            (f"ngram, {default}", ngram),
        ]
    else:
        draft = {
            "method": "draft",
            "model": str(build_draft(model, args.draft_layers)),
            "num_tokens": args.num_tokens,
        }
        layers = f"{args.draft_layers}-layer draft"
        variants = [
            ("off", None),
            (f"{layers}, always on", {**draft, **always}),
            (f"{layers}, {default}", draft),
            ("target as draft, always on", {**draft, "model": str(model), **always}),
        ]
    label = model.name if args.model == "copy-trained" else args.size
    print(
        f"model {label}, {args.max_tokens} tokens/request, k={args.num_tokens}, "
        f"method {args.method}"
    )
    print(
        f"{'batch':>5}  {'variant':<36} {'tok/s':>8} {'speed-up':>8} {'accept':>7} "
        f"{'tok/verif':>9} {'steps':>6}"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        prompt_ids = workload(batch)
        results = best_of_each(model, prompt_ids, args, variants)
        print_batch(batch, variants, results)
        if args.model == "copy-trained":
            share = copied_share(prompt_ids, results[0]["ids"])
            print(f"{'':>5}  greedy output equal to the passage: {share:.1%}")


def print_batch(batch: int, variants: list, results: list[dict]) -> None:
    """One line per variant; greedy ids must be the same in all (speculation is exact)."""
    base = results[0]
    for (name, _), r in zip(variants, results, strict=True):
        assert r["ids"] == base["ids"], f"{name}: speculation changed greedy output"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        per = "-" if r["per_verification"] is None else f"{r['per_verification']:.2f}"
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"{batch:>5}  {name:<36} {r['tokens_per_s']:>8.1f} {speedup:>7.2f}x "
            f"{acc:>7} {per:>9} {r['steps']:>6}"
        )


if __name__ == "__main__":
    main()
