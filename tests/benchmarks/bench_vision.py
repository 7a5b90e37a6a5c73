"""Captioning throughput on the tiny Qwen2.5-VL: where the time goes, and the reference engine
against transformers on the same images, in one invocation.

    .venv/bin/python tests/benchmarks/bench_vision.py [--images 48] [--max-tokens 16]
        [--size tiny] [--threads 2] [--job] [--out r.json]

Phases, each timed over every image on its own: decoding the PNG (Pillow), the model's image
processor (resize, normalise, patchify: the prompt stage's work), the vision encoder (the
engine's, per image), then generation: every captioning request submitted to the reference
engine at once (images/s and output tokens/s from the first submit to the last result), and
transformers' `generate` one image at a time (its batched path needs padded, equal image
counts), greedy with EOS ignored so both write `--max-tokens` tokens per image; the first
images' ids are compared so the work is the same work. `--job` adds a whole `tokenmill run`
job (local Parquet with an image column, one engine actor) and reports its images/s from the
run's own timings.

The peer the product is measured against on CPU, Ray Data LLM on vLLM's CPU build, cannot run
this model here: vLLM builds Qwen2.5-VL's processor with transformers' AutoProcessor, whose
video processor needs torchvision, and no torchvision imports beside this machine's CPU torch
(.venv-vllm removes it). The script checks that and reports it instead of a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SIZES = ((60, 90), (120, 80), (200, 150), (100, 100))


def _images(count: int) -> list[bytes]:
    from tests.vision_fixtures import random_images

    images = random_images([SIZES[i % len(SIZES)] for i in range(count)], seed=1, block=4)
    out = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _timed(fn, items):
    start = time.perf_counter()
    out = [fn(x) for x in items]
    return out, time.perf_counter() - start


def phases(model_dir: Path, pngs: list[bytes]) -> tuple[dict, list, list]:
    import torch

    from engines.reference.model.config import load_model_config
    from engines.reference.model.weights import load_model
    from pipeline.media.fetch import decode_image
    from pipeline.media.process import VisionProcessor
    from pipeline.spec.images import ImagesSpec

    limits = ImagesSpec()
    processor = VisionProcessor(model_dir)
    decoded, decode_s = _timed(lambda b: decode_image(b, limits), pngs)
    inputs, process_s = _timed(processor.process, decoded)
    cfg = load_model_config(model_dir)
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    pixels = [
        (torch.frombuffer(bytearray(i.pixel_values), dtype=torch.float32).view(-1, 1176), i)
        for i in inputs
    ]
    _, encode_s = _timed(lambda p: model.visual(p[0], p[1].grid_thw), pixels)
    n = len(pngs)
    return (
        {
            "decode_ms_per_image": 1e3 * decode_s / n,
            "processor_ms_per_image": 1e3 * process_s / n,
            "encoder_ms_per_image": 1e3 * encode_s / n,
            "image_tokens_per_image": sum(processor.tokens(i) for i in inputs) / n,
        },
        decoded,
        inputs,
    )


def requests_for(model_dir: Path, inputs: list, max_tokens: int) -> list:
    from transformers import AutoTokenizer

    from engines.api import GenerationRequest, SamplingParams
    from pipeline.media.process import VisionProcessor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = VisionProcessor(model_dir)
    parts = [{"type": "image"}, {"type": "text", "text": "Describe this image."}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        GenerationRequest(processor.expand(ids, (i,)), sampling, images=(i,), request_id=str(n))
        for n, i in enumerate(inputs)
    ]


def reference(model_dir: Path, requests: list, threads: int) -> tuple[dict, list]:
    from engines.reference.engine import ReferenceEngine

    # No prefix cache: the timed run repeats the warm-up's images, which it would find cached
    # (transformers caches nothing across calls either).
    engine = ReferenceEngine(
        str(model_dir), num_threads=threads, max_batch_size=64, enable_prefix_caching=False
    )
    try:

        async def main(batch):
            return await asyncio.gather(*(engine.generate(r) for r in batch))

        asyncio.run(main(requests[:8]))  # warm-up
        start = time.perf_counter()
        results = asyncio.run(main(requests))
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    tokens = sum(r.completion_tokens for r in results)
    return {
        "seconds": elapsed,
        "images_per_s": len(requests) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
    }, [r.output_token_ids for r in results]


def transformers_side(model_dir: Path, requests: list, threads: int) -> tuple[dict, list]:
    import torch

    from tests.vision_fixtures import hf_vision_greedy

    torch.set_num_threads(threads)
    hf_vision_greedy(model_dir, requests[:2])  # warm-up
    start = time.perf_counter()
    outputs = hf_vision_greedy(model_dir, requests)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {
        "seconds": elapsed,
        "images_per_s": len(requests) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
    }, outputs


def job(model_dir: Path, pngs: list[bytes], max_tokens: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.batch.driver.run import run_job
    from pipeline.spec import parse_job_spec

    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    table = pa.table(
        {
            "id": [str(i) for i in range(len(pngs))],
            "text": ["Describe this image."] * len(pngs),
            "image": pa.array(pngs, type=pa.binary()),
        }
    )
    pq.write_table(table, work / "in.parquet")
    spec = parse_job_spec(
        {
            "name": "bench-vision",
            "input": {
                "uri": str(work / "in.parquet"),
                "format": "parquet",
                "id_column": "id",
                "prompt_column": "text",
                "image_columns": ["image"],
            },
            "model": {"path": str(model_dir)},
            "engine": {"kind": "reference", "device": "cpu", "max_batch_size": 64},
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "resources": {"num_actors": 1, "cpus_per_actor": 0.5, "batch_size": 16},
            "output": {"uri": str(work / "out"), "report": False},
        }
    )
    out: dict = {}
    # The first run starts Ray in this process; the second (a fresh output) finds it running.
    for run in ("cold", "warm"):
        spec = spec.model_copy(
            update={"output": spec.output.model_copy(update={"uri": str(work / f"out-{run}")})}
        )
        start = time.perf_counter()
        result = run_job(spec)
        elapsed = time.perf_counter() - start
        out[run] = {
            "status": result.status,
            "rows": result.rows_written,
            "seconds": elapsed,
            "images_per_s": len(pngs) / elapsed,
        }
    return out


def ray_data_llm_peer() -> str:
    """Why the Ray Data LLM / vLLM side does not run here (or 'available')."""
    if not VLLM_PYTHON.exists():
        return "no .venv-vllm (make setup-vllm)"
    check = "import transformers; transformers.Qwen2VLVideoProcessor()"  # what AutoProcessor builds
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", check], capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 0:
        return "available"
    lines = [x for x in proc.stderr.strip().splitlines() if "requires the" in x]
    last = (lines or proc.stderr.strip().splitlines()[-1:] or ["?"])[0]
    return f"vLLM cannot build Qwen2.5-VL's processor in .venv-vllm: {last}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--job", action="store_true")
    parser.add_argument("--job-images", type=int, default=192)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from engines.dev.tiny import make_tiny_model

    model_dir = make_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench-vl-")) / "vl", arch="qwen2_5_vl", size=args.size
    )
    pngs = _images(args.images)
    report: dict = {"images": args.images, "max_tokens": args.max_tokens, "size": args.size}
    report["phases"], _, inputs = phases(model_dir, pngs)
    requests = requests_for(model_dir, inputs, args.max_tokens)
    report["reference"], ours = reference(model_dir, requests, args.threads)
    report["transformers"], theirs = transformers_side(model_dir, requests, args.threads)
    report["same_ids"] = ours == theirs
    report["ratio_images_per_s"] = (
        report["reference"]["images_per_s"] / report["transformers"]["images_per_s"]
    )
    if args.job:
        report["job"] = job(model_dir, _images(args.job_images), args.max_tokens)
    report["ray_data_llm"] = ray_data_llm_peer()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
