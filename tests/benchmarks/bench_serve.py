"""Serving, side by side: `tokenmill serve`, the engine alone, and vLLM's OpenAI server.

    .venv/bin/python tests/benchmarks/bench_serve.py [--sizes tiny-hd32,small] [--rounds 3]
        [--requests 200] [--concurrency 32] [--sequential 20] [--max-tokens 16] [--threads 1]
        [--peers engine,vllm,vllm-eager,elsewhere] [--[no-]one-hop] [--no-direct-ingress]
        [--out r.json]

Every side gets the same model (a tiny random Llama built here: tiny-hd32, where the HTTP path
decides, and small, 27M parameters, where the engine does real work), the same chat prompts,
the same concurrency cap, greedy decoding, and exactly --max-tokens tokens per request
(ignore_eos), so every side does the same engine work. The HTTP sides (`tokenmill serve`, and
`vllm serve` from .venv-vllm, compiled and --enforce-eager: `make setup-vllm`) are driven by the
async official OpenAI client over loopback with streamed chat completions: --requests at
--concurrency (requests/s, latency, time to first token under load), then --sequential lone
requests (latency and TTFT of one request on an idle server). The engine alone runs the same
prompts in this process first.

The `elsewhere` peer is `tokenmill serve` again with its engine process under another
environment's interpreter (replicas.engine_python = .venv-trtllm's Python: `make
setup-trtllm`), as the TensorRT-LLM image serves; `vs_elsewhere` is its overhead against the
engine process under Serve's own interpreter. With it, the model is written by that
environment (whose transformers reads only its own tokenizer format), for every side.

Per model, all servers are started once and stay up; each round measures them one after the
other, the order rotated per round, and the result is the median over --rounds. The peer is
vLLM at its best on each figure (the faster of compiled and eager). An idle server costs the
others little (a few percent of a core for Ray's and vLLM's own loops), the same for every
side. The client shares the cores with the servers, so on a small machine part of every HTTP
number is the client's own, on all sides alike. Numbers from a busy machine are only a smoke
check; take final ones on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
OTHER_PYTHON = REPO / ".venv-trtllm" / "bin" / "python"

API_KEY = "bench-key"
WORDS = ("river", "bridge", "market", "harbour", "letter", "garden", "window", "story")


def prompts(n: int) -> list[list[dict[str, str]]]:
    """n distinct short chats (distinct so the prefix cache cannot make later ones free)."""
    return [
        [{"role": "user", "content": f"Request {i}: tell me about the {WORDS[i % len(WORDS)]}."}]
        for i in range(n)
    ]


def engine_section(args: argparse.Namespace) -> dict:
    return {
        "kind": "reference",
        "device": "cpu",
        "max_batch_size": args.concurrency,
        "max_num_tokens": 512,
        "max_model_len": 512,
        "extra": {"num_threads": args.threads},
    }


def summarize(latencies: list[float], wall_s: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "requests_per_s": len(ordered) / wall_s,
        "wall_s": wall_s,
        "mean_s": statistics.fmean(ordered),
        "p50_s": ordered[len(ordered) // 2],
        "p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


async def bounded(concurrency: int, jobs) -> tuple[list[float], float]:
    """Run the coroutine factories `jobs` at most `concurrency` at a time; latencies, wall."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(job) -> None:
        async with gate:
            start = time.perf_counter()
            await job()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(job) for job in jobs))
    return latencies, time.perf_counter() - start


def bench_engine(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from engines import GenerationRequest, SamplingParams, load_engine
    from pipeline.engine_setup import engine_settings
    from pipeline.openai.chat import load_tokenizer, render_prompt
    from pipeline.spec import EngineSpec, ModelSpec, PromptSpec, StorageSpec

    spec = EngineSpec.model_validate(engine_section(args))
    tokenizer = load_tokenizer(ModelSpec(path=str(model_dir)), StorageSpec())
    ids = [render_prompt(tokenizer, PromptSpec(), messages=chat) for chat in prompts(args.requests)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = load_engine("reference", model=str(model_dir), **engine_settings(spec))
    try:

        async def run() -> tuple[list[float], float]:
            def job(prompt_ids: list[int]):
                async def call() -> None:
                    result = await engine.generate(GenerationRequest(prompt_ids, sampling))
                    assert result.completion_tokens == args.max_tokens, result

                return call

            # One warm-up request so neither side pays first-call costs in its numbers.
            await job(ids[0])()
            return await bounded(args.concurrency, [job(p) for p in ids])

        latencies, wall = asyncio.run(run())
    finally:
        engine.shutdown()
    return summarize(latencies, wall)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


# Process roles, by what their command line says (Ray sets actor and replica process titles).
ROLES = (
    ("OpenAIIngress", "ingress (one_hop: with the engine)"),
    ("EngineReplica", "engine replica"),
    ("engines.process", "engine process (replicas.engine_process)"),
    ("haproxy", "haproxy"),
    ("ServeController", "serve controller"),
    ("ProxyActor", "serve proxy"),
    ("raylet", "ray (raylet, gcs, dashboard, agents)"),
    ("gcs_server", "ray (raylet, gcs, dashboard, agents)"),
    ("dashboard", "ray (raylet, gcs, dashboard, agents)"),
    ("runtime_env", "ray (raylet, gcs, dashboard, agents)"),
    ("log_monitor", "ray (raylet, gcs, dashboard, agents)"),
    ("EngineCore", "vllm engine core"),
    ("vllm.entrypoints", "vllm api server"),
)


def cpu_by_role() -> dict[int, tuple[str, float]]:
    """Every process's role and CPU seconds so far (user + system); this process is the client."""
    import psutil

    found: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            times = proc.cpu_times()
            text = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.info["pid"] == os.getpid():
            role = "client (openai, this process)"
        else:
            role = next((name for key, name in ROLES if key in text), "other")
        found[proc.info["pid"]] = (role, times.user + times.system)
    return found


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict:
    """CPU seconds per role between two snapshots (processes that ended in between: lost)."""
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent = seconds - before.get(pid, (role, 0.0))[1]
        if spent > 0.005:
            totals[role] = totals.get(role, 0.0) + spent
    return totals


def http_workload(base_url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    """The chats as streamed chat completions through the OpenAI client: first all of them at
    --concurrency (requests/s, latency, TTFT under load), then --sequential more one at a time
    (latency and TTFT of a lone request: what an interactive user sees on an idle server)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=600)

    def job(chat: list[dict[str, str]], ttfts: list[float] | None):
        async def call() -> None:
            start = time.perf_counter()
            first = None
            tokens = 0
            stream = await client.chat.completions.create(
                model=model,
                messages=chat,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            assert tokens == args.max_tokens, tokens
            if ttfts is not None and first is not None:
                ttfts.append(first)

        return call

    loaded_ttfts: list[float] = []
    split: dict[str, float] = {}
    alone_ttfts: list[float] = []

    async def run() -> tuple[list[float], float, list[float]]:
        chats = prompts(args.requests + args.sequential)
        await job(chats[0], None)()  # warm-up: first-call costs out of the numbers
        loaded = [job(c, loaded_ttfts) for c in chats[: args.requests]]
        before = cpu_by_role()
        latencies, wall = await bounded(args.concurrency, loaded)
        split.update(cpu_delta(before, cpu_by_role()))
        alone: list[float] = []
        for chat in chats[args.requests :]:
            start = time.perf_counter()
            await job(chat, alone_ttfts)()
            alone.append(time.perf_counter() - start)
        return latencies, wall, alone

    latencies, wall, alone = asyncio.run(run())
    return {
        **summarize(latencies, wall),
        "ttft_p50_s": _pct(loaded_ttfts, 0.5),
        "ttft_p99_s": _pct(loaded_ttfts, 0.99),
        "sequential_p50_s": _pct(alone, 0.5),
        "sequential_ttft_p50_s": _pct(alone_ttfts, 0.5),
        # CPU seconds each role of the machine spent in the loaded phase, per request.
        "cpu_ms_per_request": {k: 1000 * v / args.requests for k, v in sorted(split.items())},
    }


class TokenmillServer:
    """`tokenmill serve` on the model, with the product's defaults but the bench's limits."""

    def __init__(
        self, model_dir: Path, work: Path, args: argparse.Namespace, python: Path | None = None
    ) -> None:
        from tests.e2e.serve_fixtures import start_server

        http: dict = {"cpus_per_ingress": 0.25, "access_log": args.access_log}
        if args.one_hop is not None:
            http["one_hop"] = args.one_hop
        http["direct_ingress"] = args.direct_ingress
        config = {
            "models": [
                {
                    "name": "bench",
                    "model": {"path": str(model_dir)},
                    "engine": engine_section(args),
                    "replicas": {
                        "cpus_per_replica": 0.5,
                        "max_ongoing_requests": args.concurrency,
                        "max_queued_requests": args.requests,
                        # The reference engine runs in a process of its own either way.
                        **({"engine_python": str(python)} if python else {}),
                    },
                    "limits": {
                        "max_tokens": args.max_tokens,
                        "default_max_tokens": args.max_tokens,
                    },
                }
            ],
            "http": http,
        }
        path = work / ("serve-elsewhere.yaml" if python else "serve.yaml")
        path.write_text(yaml.safe_dump(config))
        started = time.perf_counter()
        self._server = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
        self.startup_s = time.perf_counter() - started
        self.base_url = self._server.api_url

    def stop(self) -> None:
        self._server.stop()


class VllmServer:
    """vLLM's own OpenAI server (its CPU build) on the same model and limits, in its own
    environment: compiled graphs (its default) or --enforce-eager."""

    def __init__(self, model_dir: Path, work: Path, args: argparse.Namespace, eager: bool) -> None:
        import httpx

        from tests.e2e.serve_fixtures import free_port

        if not VLLM_PYTHON.exists():
            raise SystemExit(
                f"{VLLM_PYTHON} not found: `make setup-vllm` first, or drop the vllm peers"
            )
        port = free_port()
        command = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "bench",
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            str(args.concurrency),
            "--max-num-batched-tokens",
            "512",
            *(["--enforce-eager"] if eager else []),
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny models need far less
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        }
        self._log = (work / f"vllm-serve-{'eager' if eager else 'compiled'}.log").open("w")
        started = time.perf_counter()
        self._proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        deadline = started + 600
        headers = {"Authorization": f"Bearer {API_KEY}"}
        while True:
            if self._proc.poll() is not None:
                raise SystemExit(
                    f"vllm serve exited ({self._proc.returncode}); see {self._log.name}"
                )
            try:
                if (
                    httpx.get(f"{self.base_url}/models", headers=headers, timeout=5).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise SystemExit("vllm serve did not come up within 600 s")
            time.sleep(1)
        self.startup_s = time.perf_counter() - started

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


METRICS = (
    "requests_per_s",
    "mean_s",
    "p50_s",
    "p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "sequential_p50_s",
    "sequential_ttft_p50_s",
)


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in METRICS if k in rounds[0]]
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


def bench_size(size: str, work: Path, args: argparse.Namespace, peers: set[str]) -> dict:
    """Every side on one model: the engine alone first (in this process), then the servers,
    all up at once and measured in turn, the order rotated each round so that a slow spell
    of the machine does not fall on one side only."""
    from engines.dev.tiny import make_tiny_model

    if "elsewhere" in peers:
        model_dir = work / f"model-{size}"
        build = (
            "import sys; from engines.dev.tiny import make_tiny_model; "
            "make_tiny_model(sys.argv[1], arch='llama', size=sys.argv[2])"
        )
        subprocess.run([str(OTHER_PYTHON), "-c", build, str(model_dir), size], check=True)
    else:
        model_dir = make_tiny_model(work / f"model-{size}", arch="llama", size=size)
    result: dict = {}
    if "engine" in peers:
        result["engine"] = {"rounds": [bench_engine(model_dir, args) for _ in range(args.rounds)]}
    servers: dict[str, TokenmillServer | VllmServer] = {}
    try:
        servers["serve"] = TokenmillServer(model_dir, work, args)
        if "elsewhere" in peers:
            servers["serve_elsewhere"] = TokenmillServer(model_dir, work, args, OTHER_PYTHON)
        if "vllm" in peers:
            servers["vllm_compiled"] = VllmServer(model_dir, work, args, eager=False)
        if "vllm-eager" in peers:
            servers["vllm_eager"] = VllmServer(model_dir, work, args, eager=True)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        names = list(servers)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(http_workload(servers[name].base_url, "bench", args))
                print(
                    f"{size} round {r + 1} {name}: {runs[name][-1]['requests_per_s']:.2f} req/s",
                    file=sys.stderr,
                )
        for name, server in servers.items():
            result[name] = {"startup_s": server.startup_s, "rounds": runs[name]}
    finally:
        for server in servers.values():
            server.stop()
    for side in result.values():
        side["median"] = medians(side["rounds"])
    serve = result["serve"]["median"]
    vllm_sides = [result[k]["median"] for k in ("vllm_compiled", "vllm_eager") if k in result]
    if vllm_sides:
        # The peer is vLLM at its best on each figure: the faster of compiled and eager.
        best = {
            "requests_per_s": max(v["requests_per_s"] for v in vllm_sides),
            "sequential_p50_s": min(v["sequential_p50_s"] for v in vllm_sides),
            "sequential_ttft_p50_s": min(v["sequential_ttft_p50_s"] for v in vllm_sides),
            "ttft_p50_s": min(v["ttft_p50_s"] for v in vllm_sides),
        }
        result["vs_vllm"] = {
            # Above 1 is better for tokenmill.
            "requests_per_s": serve["requests_per_s"] / best["requests_per_s"],
            # At or below 1 is better for tokenmill.
            "sequential_p50": serve["sequential_p50_s"] / best["sequential_p50_s"],
            "sequential_ttft_p50": serve["sequential_ttft_p50_s"] / best["sequential_ttft_p50_s"],
            "loaded_ttft_p50": serve["ttft_p50_s"] / best["ttft_p50_s"],
        }
    if "serve_elsewhere" in result:
        there = result["serve_elsewhere"]["median"]
        result["vs_elsewhere"] = {
            # The engine process under another interpreter against under Serve's own: near 1.
            "requests_per_s": there["requests_per_s"] / serve["requests_per_s"],
            "ttft_p50": there["ttft_p50_s"] / serve["ttft_p50_s"],
            "sequential_ttft_p50": there["sequential_ttft_p50_s"] / serve["sequential_ttft_p50_s"],
        }
    if "engine" in result:
        engine = result["engine"]["median"]
        result["vs_engine"] = {
            "requests_per_s": serve["requests_per_s"] / engine["requests_per_s"],
            "overhead_p50_s": serve["p50_s"] - engine["p50_s"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=20, help="lone requests after the load")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="medians over this many rounds")
    # tiny-hd32: vLLM's CPU attention needs a head dimension of at least 32.
    parser.add_argument(
        "--sizes",
        default="tiny-hd32,small",
        help="comma-separated models (tiny-hd32, tiny, small): tiny-hd32 shows the HTTP path, "
        "small (27M parameters) a model that keeps the engine busy",
    )
    parser.add_argument(
        "--peers",
        default="engine,vllm,vllm-eager",
        help="comma-separated sides to compare tokenmill serve with: engine (alone), vllm "
        "(compiled graphs, its default), vllm-eager (--enforce-eager), elsewhere (the engine "
        "process under .venv-trtllm's interpreter)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep Serve's per-request access log lines (http.access_log)",
    )
    parser.add_argument(
        "--one-hop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="http.one_hop of tokenmill serve (the engine inside the ingress replica); "
        "unset: the product's default (on for one model)",
    )
    parser.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="http.direct_ingress of tokenmill serve (HAProxy straight to the replicas, the "
        "default); --no-direct-ingress: through Serve's proxy actor",
    )
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    result: dict = {"settings": vars(args) | {"out": str(args.out) if args.out else None}}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for size in sizes:
            result[size] = bench_size(size, Path(tmp), args, peers)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    for size in sizes:
        for side, numbers in result[size].items():
            split = (
                numbers.get("rounds", [{}])[-1].get("cpu_ms_per_request")
                if isinstance(numbers, dict)
                else None
            )
            if split:
                parts = ", ".join(f"{role} {ms:.1f}" for role, ms in split.items())
                print(f"{size} {side}: CPU ms per request under load: {parts}")
        ratios = result[size].get("vs_vllm")
        if ratios:
            print(
                f"{size} vs vLLM at its best: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            )
        ratios = result[size].get("vs_elsewhere")
        if ratios:
            print(
                f"{size} engine under another interpreter vs Serve's own: "
                + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
            )


if __name__ == "__main__":
    main()
