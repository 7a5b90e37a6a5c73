"""Usage records and the usage log (a local file and an object prefix), and the prompt length
check from bytes before tokenizing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engines.api import EngineInfo
from pipeline.openai.errors import ApiError
from pipeline.openai.models import parse_chat_request, parse_completion_request
from pipeline.openai.responses import Usage
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.protocol.requests import check_prompt_bytes
from pipeline.serve.spec import ServedModelSpec, UsageLogSpec
from pipeline.serve.usage import (
    FileSink,
    PrefixSink,
    UsageAccounting,
    UsageLog,
    UsageRecord,
    sink_for,
)
from pipeline.spec import StorageSpec

USAGE = Usage(
    prompt_tokens=12,
    completion_tokens=5,
    cached_tokens=4,
    gpu_seconds=0.25,
    cost_usd=0.0035,
    list_price_usd=0.0001,
)


def record(request_id: str = "chatcmpl-1", usage: Usage | None = USAGE, status: int = 200):
    return UsageRecord.of(
        key="team-a",
        model="tiny",
        endpoint="chat",
        request_id=request_id,
        status=status,
        stream=False,
        usage=usage,
        latency_s=0.5,
        now=1767225600.1234,  # 2026-01-01T00:00:00.123Z
    )


def test_a_record_is_one_json_line_with_usage_and_cost() -> None:
    line = record().line()
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == {
        "time": "2026-01-01T00:00:00.123Z",
        "key": "team-a",
        "model": "tiny",
        "endpoint": "chat",
        "request_id": "chatcmpl-1",
        "status": 200,
        "stream": False,
        "prompt_tokens": 12,
        "cached_tokens": 4,
        "completion_tokens": 5,
        "gpu_seconds": 0.25,
        "cost_usd": 0.0035,
        "list_price_usd": 0.0001,
        "latency_s": 0.5,
        "adapter": None,
    }
    abandoned = json.loads(record(usage=None, status=499).line())
    assert abandoned["completion_tokens"] == 0 and abandoned["cost_usd"] == 0.0


def test_file_log_appends_batches_and_keeps_a_failed_batch(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "usage.jsonl"
    errors: list[int] = []
    log = UsageLog(FileSink(str(path)), 60, 100, on_write_error=lambda: errors.append(1))
    assert log.add(record("a")) and log.add(record("b"))
    assert log.flush() == 2
    log.add(record("c"))
    assert log.flush() == 1
    assert log.flush() == 0  # nothing pending
    ids = [json.loads(ln)["request_id"] for ln in path.read_text().splitlines()]
    assert ids == ["a", "b", "c"]

    class Broken:
        def __init__(self) -> None:
            self.fail = True
            self.data = b""

        def write(self, data: bytes) -> None:
            if self.fail:
                raise OSError("disk full")
            self.data += data

    sink = Broken()
    log = UsageLog(sink, 60, 3)
    log.add(record("x"))
    log.add(record("y"))
    assert log.flush() == 0 and log.pending == 2  # kept
    log.add(record("z"))
    assert not log.add(record("dropped"))  # bounded: 3 pending at most
    sink.fail = False
    log.close()  # shutdown writes what is left
    assert [json.loads(ln)["request_id"] for ln in sink.data.decode().splitlines()] == [
        "x",
        "y",
        "z",
    ]


def test_prefix_log_writes_a_new_object_per_batch(tmp_path: Path) -> None:
    # The object-store sink, on a local prefix (same OutputDir code as for s3://).
    sink = PrefixSink(str(tmp_path / "usage"), StorageSpec(), replica="ingress#abc 1")
    log = UsageLog(sink, 60, 100)
    log.add(record("a"))
    log.flush()
    log.add(record("b"))
    log.add(record("c"))
    log.flush()
    objects = sorted((tmp_path / "usage").glob("usage-*.jsonl"))
    assert len(objects) == 2
    assert all("-ingress-abc-1-" in p.name for p in objects)
    lines = [json.loads(ln) for p in objects for ln in p.read_text().splitlines()]
    assert [r["request_id"] for r in lines] == ["a", "b", "c"]
    assert isinstance(sink_for(UsageLogSpec(uri="s3://b/usage/"), StorageSpec(), "r"), PrefixSink)
    assert isinstance(
        sink_for(UsageLogSpec(uri=str(tmp_path / "u.jsonl")), StorageSpec(), "r"), FileSink
    )


def test_accounting_counts_per_key_and_logs_only_engine_requests(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServeMetrics()
    log = UsageLog(FileSink(str(tmp_path / "u.jsonl")), 60, 100)
    accounting = UsageAccounting(metrics, log)
    accounting.finished(
        key="team-a",
        model="tiny",
        endpoint="chat",
        request_id="r1",
        status=200,
        stream=True,
        usage=USAGE,
        latency_s=0.1,
    )
    accounting.refused("team-a", "tiny", 429)
    log.flush()
    assert len((tmp_path / "u.jsonl").read_text().splitlines()) == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }
    labels = (("key", "team-a"), ("model", "tiny"))
    assert samples[("tokenmill_serve_key_prompt_tokens_total", labels)] == 12
    assert samples[("tokenmill_serve_key_cached_prompt_tokens_total", labels)] == 4
    assert samples[("tokenmill_serve_key_completion_tokens_total", labels)] == 5
    assert samples[("tokenmill_serve_key_cost_usd_total", labels)] == pytest.approx(0.0035)
    for status in ("200", "429"):
        assert samples[("tokenmill_serve_key_requests_total", (*labels, ("status", status)))] == 1


# --- prompt length from bytes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from engines.dev.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("bytes") / "tiny", arch="llama")
    return AutoTokenizer.from_pretrained(str(path))


def test_bytes_per_token_bound_holds_for_any_text(tiny_tokenizer) -> None:
    from pipeline.serve.protocol.tokens import bytes_per_token_bound

    bound = bytes_per_token_bound(tiny_tokenizer)
    assert bound is not None and bound >= 1
    rng = random.Random(0)
    alphabet = "ab cd\n\t  ééü中文🙂" + "".join(tiny_tokenizer.all_special_tokens)
    samples = ["", " " * 500, "<|im_start|>" * 40, "the river and the bridge " * 50]
    samples += [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(50)
    ]
    for text in samples:
        tokens = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert len(text.encode()) <= tokens * bound, text[:40]


def test_no_bound_for_tokenizers_that_can_drop_text() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipeline.serve.protocol.tokens import bytes_per_token_bound

    def fast(pre, norm=None, model=None):
        vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}
        bpe = models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="[UNK]")
        tok = Tokenizer(model or bpe)
        tok.pre_tokenizer = pre
        if norm is not None:
            tok.normalizer = norm
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    assert bytes_per_token_bound(fast(pre_tokenizers.Whitespace())) is None  # drops spaces
    assert bytes_per_token_bound(fast(pre_tokenizers.ByteLevel(), normalizers.Strip())) is None
    assert bytes_per_token_bound(fast(pre_tokenizers.Metaspace())) is None  # unknown -> one [UNK]
    nfkc = bytes_per_token_bound(fast(pre_tokenizers.ByteLevel(), normalizers.NFKC()))
    plain = bytes_per_token_bound(fast(pre_tokenizers.ByteLevel()))
    assert plain == len("[UNK]") and nfkc == 4 * plain
    assert bytes_per_token_bound(object()) is None  # a slow tokenizer: nothing to inspect


def served(max_prompt_tokens: int | None = None) -> ServedModelSpec:
    limits = {"max_prompt_tokens": max_prompt_tokens} if max_prompt_tokens else {}
    return ServedModelSpec.model_validate(
        {"name": "tiny", "model": {"path": "/m"}, "limits": limits}
    )


INFO = EngineInfo("reference", "/m", 101, "cpu", 1, "float32", True)


def test_only_a_prompt_that_certainly_cannot_fit_is_refused_before_tokenizing() -> None:
    # Cap 100 tokens, at most 4 bytes a token: over 400 bytes cannot fit.
    fits = parse_completion_request({"model": "tiny", "prompt": "x" * 400})
    check_prompt_bytes(fits, served(), INFO, max_bytes_per_token=4)
    too_long = parse_completion_request({"model": "tiny", "prompt": ["x" * 401]})
    with pytest.raises(ApiError) as err:
        check_prompt_bytes(too_long, served(), INFO, max_bytes_per_token=4)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "at least 101 tokens" in err.value.message and err.value.param == "prompt"
    # max_prompt_tokens lowers the cap; no bound: never refused here.
    with pytest.raises(ApiError):
        check_prompt_bytes(fits, served(max_prompt_tokens=50), INFO, max_bytes_per_token=4)
    check_prompt_bytes(too_long, served(), INFO, max_bytes_per_token=None)
    # Token ids are not text: counted exactly later.
    ids = parse_completion_request({"model": "tiny", "prompt": list(range(500))})
    check_prompt_bytes(ids, served(), INFO, max_bytes_per_token=1)


def test_chats_count_only_their_user_text() -> None:
    long_system = {"role": "system", "content": "s" * 10_000}  # templates may drop or trim it
    chat = parse_chat_request(
        {"model": "tiny", "messages": [long_system, {"role": "user", "content": "  hi  "}]}
    )
    check_prompt_bytes(chat, served(), INFO, max_bytes_per_token=4)
    chat = parse_chat_request(
        {"model": "tiny", "messages": [{"role": "user", "content": "u" * 401}]}
    )
    with pytest.raises(ApiError) as err:
        check_prompt_bytes(chat, served(), INFO, max_bytes_per_token=4)
    assert err.value.param == "messages"
