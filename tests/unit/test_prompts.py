"""Prompt rendering, per-row sampling and the prompt stage on a locally trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.batch.columns import (
    MAX_TOKENS,
    PROMPT_TOKEN_IDS,
    PROMPT_TOKENS,
    SEED,
    STAGE_COLUMNS,
    TEMPERATURE,
    TOO_LONG,
    TOP_K,
    TOP_P,
)
from pipeline.batch.stages.prompts import (
    PromptStage,
    derive_seed,
    render_user_text,
    resolve_sampling,
)
from pipeline.openai.chat import PromptError, chat_messages, render_prompt
from pipeline.spec import JobSpec, PromptSpec, parse_job_spec

CONTEXT = 96  # max_position_embeddings of the test "model": small, so rows can exceed it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer with a chat template and a config.json; no weights (prompts needs none)."""
    from engines.dev.tiny import train_tokenizer

    path = tmp_path_factory.mktemp("prompt-model")
    train_tokenizer(512).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_spec(model_dir: Path, **sections: Any) -> JobSpec:
    data: dict[str, Any] = {
        "name": "prompts",
        "input": {"uri": "/in.jsonl", "format": "jsonl", "prompt_column": "q"},
        "model": {"path": str(model_dir)},
        "output": {"uri": "/out"},
        "sampling": {"max_tokens": 8},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_job_spec(data)


# --- rendering ---------------------------------------------------------------------------------


def test_chat_template_with_system_prompt_and_generation_prompt(tokenizer: Any) -> None:
    spec = PromptSpec(system_prompt="Be brief.")
    ids = render_prompt(tokenizer, spec, text="What is a bridge?")
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is a bridge?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_kwargs_reach_the_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    # A fresh copy: the module's tokenizer keeps its own template for the other tests.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}no-think{% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}]
    plain = tokenizer.decode(render_prompt(tokenizer, PromptSpec(), messages=chat))
    off = render_prompt(
        tokenizer, PromptSpec(), messages=chat, template_kwargs={"enable_thinking": False}
    )
    assert "no-think" not in plain and tokenizer.decode(off).endswith("no-think")


def test_plain_text_is_tokenized_as_is(tokenizer: Any) -> None:
    ids = render_prompt(tokenizer, PromptSpec(chat_template=False), text="the river runs")
    assert ids == tokenizer.encode("the river runs")
    assert tokenizer.decode(ids) == "the river runs"


def test_messages_keep_their_own_system_message(tokenizer: Any) -> None:
    chat = [
        {"role": "system", "content": "Own system."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    text = tokenizer.decode(render_prompt(tokenizer, PromptSpec(system_prompt="X"), messages=chat))
    assert text.count("<|im_start|>system") == 1 and "Own system." in text and "X" not in text
    assert text.endswith("again<|im_end|>\n<|im_start|>assistant\n")
    # JSON text of the same chat renders the same tokens.
    assert render_prompt(tokenizer, PromptSpec(), messages=json.dumps(chat)) == render_prompt(
        tokenizer, PromptSpec(), messages=chat
    )


def test_developer_role_and_text_parts_are_normalized() -> None:
    chat = chat_messages(
        [
            {"role": "developer", "content": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert chat == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("not json", "messages is not valid JSON"),
        ("{}", "non-empty list"),
        ([], "non-empty list"),
        ([{"content": "x"}], r"messages\[0\] must be an object with role and content"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role 'wizard' is not one of"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be text"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\].content\[0\].image_url.url must be a non-empty string",
        ),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            r"messages\[0\].content\[0\] has type 'input_audio'; content parts may be text or",
        ),
        ([{"role": "user", "content": "  "}], "messages are all empty"),
    ],
)
def test_invalid_messages(messages: Any, expected: str) -> None:
    with pytest.raises(PromptError, match=expected):
        chat_messages(messages)


def test_messages_need_the_chat_template(tokenizer: Any) -> None:
    with pytest.raises(PromptError, match="chat_template: true"):
        render_prompt(
            tokenizer, PromptSpec(chat_template=False), messages=[{"role": "user", "content": "x"}]
        )


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_prompt(tokenizer: Any, text: str) -> None:
    with pytest.raises(PromptError, match="empty prompt"):
        render_prompt(tokenizer, PromptSpec(), text=text)
    with pytest.raises(PromptError, match="empty prompt"):
        render_user_text({"prompt": text}, PromptSpec())


def test_template_over_row_columns() -> None:
    spec = PromptSpec(template="[{{ lang | upper }}] {{ title }}: {{ prompt }}")
    row = {"prompt": "body text", "title": "Title", "lang": "en", "unused": 1}
    assert render_user_text(row, spec) == "[EN] Title: body text"


def test_template_errors_are_prompt_errors() -> None:
    with pytest.raises(PromptError, match=r"prompt\.template: UndefinedError: 'title' is"):
        render_user_text({"prompt": "x"}, PromptSpec(template="{{ title }}"))
    with pytest.raises(PromptError, match="empty prompt after the template"):
        render_user_text({"title": ""}, PromptSpec(template="{{ title }}"))


# --- sampling ----------------------------------------------------------------------------------


def test_derive_seed_is_stable_and_row_specific() -> None:
    assert derive_seed(7, "row-1") == derive_seed(7, "row-1")
    assert derive_seed(7, "row-1") != derive_seed(7, "row-2")
    assert derive_seed(7, "row-1") != derive_seed(8, "row-1")


@given(st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=40))
def test_derived_seeds_fit_int64(seed: int, row_id: str) -> None:
    assert 0 <= derive_seed(seed, row_id) < 2**63


def test_resolve_sampling_defaults_and_overrides(model_dir: Path) -> None:
    spec = make_spec(model_dir, sampling={"temperature": 0.3, "top_k": 5, "seed": 11})
    overrides = {"max_tokens": "mt", "temperature": "t"}
    values, problem = resolve_sampling({"id": "a", "mt": 3, "t": None}, spec, overrides)
    assert problem is None
    assert values == {
        MAX_TOKENS: 3,
        TEMPERATURE: 0.3,
        TOP_P: 1.0,
        TOP_K: 5,
        SEED: derive_seed(11, "a"),
        "response_format": None,
        "logprobs": None,
        "num_samples": 1,
        "reasoning_effort": None,
    }
    values, _ = resolve_sampling({"id": "a", "s": 99}, spec, {"seed": "s"})
    assert values[SEED] == 99  # an explicit per-row seed is used as given


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_tokens", 0, "0 must be >= 1"),
        ("max_tokens", 2.5, "must be an integer"),
        ("temperature", -1.0, "-1.0 must be >= 0"),
        ("top_p", 0.0, "0.0 must be in (0, 1]"),
        ("top_p", float("inf"), "must be a finite number"),
        ("top_k", -2, "must be >= 0"),
        ("seed", 2**64, "must fit in int64"),
        ("n", 0, "must be in [1, 128]"),
        ("n", 1.5, "must be an integer"),
    ],
)
def test_invalid_override_names_column_and_value(
    model_dir: Path, field: str, value: Any, expected: str
) -> None:
    spec = make_spec(model_dir)
    _, problem = resolve_sampling({"id": "r", "col": value}, spec, {field: "col"})
    assert problem is not None
    assert problem.startswith(f"column 'col' (sampling.overrides.{field}): ")
    assert expected in problem


# --- the stage -------------------------------------------------------------------------------


def test_prompt_stage_batch(model_dir: Path, tokenizer: Any) -> None:
    spec = make_spec(
        model_dir,
        input={"passthrough_columns": ["user"]},
        sampling={"max_tokens": 8, "overrides": {"max_tokens": "mt"}},
    )
    long_prompt = " ".join(["river"] * 200)
    batch = pa.table(
        {
            "id": ["ok", "override", "bad-override", "read-error", "too-long", "empty", "chat"],
            "prompt": ["hello there", "hello there", "x", None, long_prompt, "", None],
            "messages": [None] * 6 + [json.dumps([{"role": "user", "content": "hi"}])],
            "error": [None, None, None, "file.jsonl line 3: not valid JSON", None, None, None],
            "user": [1, 2, 3, 4, 5, 6, 7],
            "mt": [None, 20, 0, None, None, None, None],
        }
    )
    out = PromptStage(spec)(batch)
    assert out.num_rows == batch.num_rows
    assert out.column("user").to_pylist() == [1, 2, 3, 4, 5, 6, 7]
    assert out.schema.field(PROMPT_TOKEN_IDS).type == pa.list_(pa.int32())
    assert out.schema.field(PROMPT_TOKENS).type == pa.int32()
    assert out.schema.field(MAX_TOKENS).type == pa.int32()
    assert out.schema.field(SEED).type == pa.int64()
    rows = {r["id"]: r for r in out.to_pylist()}

    expected_ids = render_prompt(tokenizer, spec.prompt, text="hello there")
    assert rows["ok"]["error"] is None
    assert rows["ok"][PROMPT_TOKEN_IDS] == expected_ids
    assert rows["ok"][PROMPT_TOKENS] == len(expected_ids)
    assert rows["ok"][MAX_TOKENS] == 8 and rows["override"][MAX_TOKENS] == 20
    assert rows["ok"][SEED] is None  # no sampling.seed, no override

    assert (
        "column 'mt' (sampling.overrides.max_tokens): 0 must be >= 1"
        in rows["bad-override"]["error"]
    )
    assert rows["read-error"]["error"] == "file.jsonl line 3: not valid JSON"
    assert rows["read-error"][PROMPT_TOKEN_IDS] == [] and rows["read-error"][PROMPT_TOKENS] == 0

    too_long = rows["too-long"]["error"]
    assert too_long.startswith(TOO_LONG)
    n = len(render_prompt(tokenizer, spec.prompt, text=long_prompt))
    assert f"prompt has {n} tokens + max_tokens 8 = {n + 8} > context length {CONTEXT}" in too_long

    assert rows["empty"]["error"] == "empty prompt"
    assert rows["chat"]["error"] is None
    assert tokenizer.decode(rows["chat"][PROMPT_TOKEN_IDS]).endswith("<|im_start|>assistant\n")


def test_context_violation_is_exactly_at_the_limit(model_dir: Path, tokenizer: Any) -> None:
    spec = make_spec(model_dir)
    n = len(render_prompt(tokenizer, spec.prompt, text="hello there"))
    fits = make_spec(model_dir, engine={"max_model_len": n + 8})
    over = make_spec(model_dir, engine={"max_model_len": n + 7})
    row = {"id": "r", "prompt": "hello there", "messages": None, "error": None}
    assert PromptStage(fits).process_row(row)["error"] is None
    assert f"context length {n + 7}" in PromptStage(over).process_row(row)["error"]


def test_stage_replaces_existing_sampling_columns(model_dir: Path) -> None:
    spec = make_spec(model_dir, sampling={"overrides": {"max_tokens": "max_tokens"}})
    batch = pa.table(
        {
            "id": ["a"],
            "prompt": ["hi"],
            "messages": pa.array([None], pa.string()),
            "error": pa.array([None], pa.string()),
            "max_tokens": pa.array([5], pa.int64()),
        }
    )
    out = PromptStage(spec)(batch)
    assert out.column_names.count("max_tokens") == 1
    assert out.column("max_tokens").to_pylist() == [5]
    assert set(STAGE_COLUMNS) <= set(out.column_names)


def test_openai_batch_completions_are_raw_text(model_dir: Path, tokenizer: Any) -> None:
    spec = parse_job_spec(
        {
            "name": "batch",
            "input": {"uri": "/in.jsonl", "format": "openai_batch"},
            "prompt": {"system_prompt": "Be brief."},
            "model": {"path": str(model_dir)},
            "output": {"uri": "/out"},
            "sampling": {"max_tokens": 8},
        }
    )
    stage = PromptStage(spec)
    completion = {"id": "c", "prompt": "Once upon", "messages": None, "error": None}
    assert stage.process_row(completion)[PROMPT_TOKEN_IDS] == tokenizer.encode("Once upon")
    chat = {"id": "m", "prompt": None, "messages": '[{"role": "user", "content": "hi"}]'}
    text = tokenizer.decode(stage.process_row({**chat, "error": None})[PROMPT_TOKEN_IDS])
    assert text.startswith("<|im_start|>system\nBe brief.") and "hi" in text


def test_logprobs_and_response_format_resolve_per_row(model_dir: Path) -> None:
    spec = make_spec(
        model_dir,
        sampling={
            "logprobs": 3,
            "response_format": {"type": "json_object"},
            "overrides": {"logprobs": "lp", "response_format": "fmt"},
        },
    )
    overrides = {"logprobs": "lp", "response_format": "fmt"}
    values, problem = resolve_sampling({"id": "a"}, spec, overrides)
    assert problem is None
    assert values["logprobs"] == 3
    assert json.loads(values["response_format"]) == {"type": "json_object"}
    row = {"id": "b", "lp": 0, "fmt": {"type": "choice", "choices": ["x"]}}
    values, problem = resolve_sampling(row, spec, overrides)
    assert problem is None and values["logprobs"] == 0
    assert json.loads(values["response_format"])["choices"] == ["x"]
    values, problem = resolve_sampling({"id": "c", "fmt": '{"type": "text"}'}, spec, overrides)
    assert problem is None and json.loads(values["response_format"]) == {"type": "text"}
    _, problem = resolve_sampling({"id": "d", "lp": 25}, spec, overrides)
    assert "'lp'" in problem and "[0, 20]" in problem
    _, problem = resolve_sampling({"id": "e", "fmt": '{"type": "nope"}'}, spec, overrides)
    assert "'fmt'" in problem and "type must be one of" in problem


# --- the batched stage against the one-row path ------------------------------------------------


def _one_by_one(stage: PromptStage) -> PromptStage:
    """The same stage with every row rendered on its own (process_row), as it once was."""
    stage.process_rows = lambda rows: [stage.process_row(row) for row in rows]  # type: ignore[method-assign]
    return stage


def _chat(*turns: tuple[str, Any]) -> str:
    return json.dumps([{"role": role, "content": content} for role, content in turns])


VARIED_ROWS: list[dict[str, Any]] = [
    {"id": "text", "prompt": "hello there", "messages": None, "error": None, "mt": None},
    {"id": "unicode", "prompt": "  Größe: 北京 🚀\n", "messages": None, "error": None, "mt": 3},
    {"id": "chat", "prompt": None, "messages": _chat(("user", "hi")), "error": None, "mt": None},
    {
        "id": "chat-own-system",
        "prompt": None,
        "messages": _chat(("developer", "Terse."), ("user", [{"type": "text", "text": "a"}])),
        "error": None,
        "mt": None,
    },
    {
        "id": "chat-turns",
        "prompt": None,
        "messages": _chat(("user", "one"), ("assistant", "two"), ("user", "three")),
        "error": None,
        "mt": 2,
    },
    {"id": "bad-json", "prompt": None, "messages": "[{", "error": None, "mt": None},
    {"id": "bad-role", "prompt": None, "messages": _chat(("bot", "x")), "error": None, "mt": None},
    {
        "id": "image",
        "prompt": None,
        "messages": _chat(("user", [{"type": "image_url"}])),
        "error": None,
        "mt": None,
    },
    {"id": "empty", "prompt": "   ", "messages": None, "error": None, "mt": None},
    {"id": "missing", "prompt": None, "messages": None, "error": None, "mt": None},
    {"id": "read-error", "prompt": None, "messages": None, "error": "line 3: not JSON", "mt": None},
    {"id": "bad-override", "prompt": "hello", "messages": None, "error": None, "mt": 0},
    {
        "id": "too-long",
        "prompt": " ".join(["river"] * 200),
        "messages": None,
        "error": None,
        "mt": None,
    },
    {"id": "fits-exactly", "prompt": "river " * 20, "messages": None, "error": None, "mt": None},
]


def _varied_table(rows: list[dict[str, Any]] = VARIED_ROWS) -> pa.Table:
    return pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("id", pa.string()),
                ("prompt", pa.string()),
                ("messages", pa.string()),
                ("error", pa.string()),
                ("mt", pa.int64()),
            ]
        ),
    )


def _openai_batch_spec(model_dir: Path) -> JobSpec:
    """openai_batch: raw completions (no chat template) beside chats."""
    return parse_job_spec(
        {
            "name": "batch",
            "input": {"uri": "/in.jsonl", "format": "openai_batch"},
            "prompt": {"system_prompt": "Be brief."},
            "model": {"path": str(model_dir)},
            "output": {"uri": "/out"},
            "sampling": {"max_tokens": 8, "overrides": {"max_tokens": "mt"}},
        }
    )


@pytest.mark.parametrize(
    "sections",
    [
        {},  # text prompts through the chat template
        {"prompt": {"system_prompt": "Be brief."}},
        {"prompt": {"chat_template": False}},  # text as is; chats are errors
        {"prompt": {"template": "Q: {{ prompt.strip() }}"}},  # fails on a null prompt
        None,
    ],
    ids=["chat-template", "system-prompt", "raw-text", "prompt-template", "openai-batch"],
)
def test_batched_stage_equals_the_one_row_path(
    model_dir: Path, sections: dict[str, Any] | None
) -> None:
    if sections is None:
        spec = _openai_batch_spec(model_dir)
    else:
        overrides = {"max_tokens": 8, "overrides": {"max_tokens": "mt"}}
        spec = make_spec(model_dir, sampling=overrides, **sections)
    table = _varied_table()
    batched = PromptStage(spec)(table)
    one_by_one = _one_by_one(PromptStage(spec))(table)
    assert batched.schema == one_by_one.schema
    for got, want in zip(batched.to_pylist(), one_by_one.to_pylist(), strict=True):
        assert got == want, got["id"]
    # The rows cover what they claim: errors of each kind, tokens, and the context limit.
    rows = {row["id"]: row for row in batched.to_pylist()}
    assert rows["read-error"]["error"] == "line 3: not JSON"
    assert "sampling.overrides.max_tokens" in rows["bad-override"]["error"]
    assert rows["too-long"]["error"].startswith(TOO_LONG)
    assert rows["missing"]["error"] is not None
    assert rows["text"]["error"] is None and rows["text"][PROMPT_TOKENS] > 0


def test_render_rows_equals_render_row(model_dir: Path, tokenizer: Any) -> None:
    from pipeline.batch.stages.prompts import render_row, render_rows

    spec = make_spec(model_dir, prompt={"system_prompt": "Be brief."})
    rows = [r for r in VARIED_ROWS if r["error"] is None]
    expected: list[Any] = []
    for row in rows:
        try:
            expected.append(render_row(row, spec, tokenizer))
        except PromptError as exc:
            expected.append(f"error: {exc}")
    got = [r if isinstance(r, list) else f"error: {r}" for r in render_rows(rows, spec, tokenizer)]
    assert got == expected
    assert any(isinstance(e, str) for e in expected) and any(isinstance(e, list) for e in expected)


def test_a_template_failing_on_one_chat_fails_only_that_row(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    import pipeline.batch.stages.prompts as prompts

    monkeypatch.setattr(prompts, "TEMPLATE_CHUNK", 3)  # several chunks, one of them failing
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if 'forbidden' in m.content %}"
        "{{ raise_exception('no forbidden words') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    spec = make_spec(model_dir)
    words = ["alpha", "beta", "forbidden fruit", "gamma", "delta", "epsilon", "zeta"]
    table = _varied_table(
        [{"id": w, "prompt": w, "messages": None, "error": None, "mt": None} for w in words]
    )
    stage, reference = PromptStage(spec), _one_by_one(PromptStage(spec))
    stage.tokenizer = reference.tokenizer = tokenizer
    batched, one_by_one = stage(table), reference(table)
    assert batched.equals(one_by_one)
    errors = batched.column("error").to_pylist()
    assert errors[2] == "chat template failed: TemplateError: no forbidden words"
    assert errors[:2] + errors[3:] == [None] * 6


class _NoBatches:
    """A tokenizer whose batched call fails: the stage falls back to encoding row by row."""

    def __init__(self, tokenizer: Any, bad_text: str | None = None) -> None:
        self._tokenizer, self._bad_text = tokenizer, bad_text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no batches here")

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        if text == self._bad_text:
            raise RuntimeError(f"cannot encode {text!r}")
        return self._tokenizer.encode(text, **kwargs)


def test_a_failing_batch_encode_falls_back_to_rows(model_dir: Path, tokenizer: Any) -> None:
    spec = _openai_batch_spec(model_dir)
    table = _varied_table()
    stage, reference = PromptStage(spec), _one_by_one(PromptStage(spec))
    stage.tokenizer = _NoBatches(tokenizer)
    assert stage(table).equals(reference(table))
    # A text that cannot be encoded at all fails the batch as it did row by row.
    stage.tokenizer = _NoBatches(tokenizer, bad_text="hello there")
    with pytest.raises(RuntimeError, match="cannot encode 'hello there'"):
        stage(table)
