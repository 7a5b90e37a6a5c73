"""JobSpec: every error names its field; `{{ date }}`, `${VAR}` and `--set` rendering."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.spec import (
    JobSpec,
    SpecError,
    apply_overrides,
    docgen,
    env_references,
    load_job_spec,
    load_yaml,
    parse_job_spec,
)

MINIMAL: dict[str, Any] = {
    "name": "job-1",
    "input": {"uri": "s3://bucket/in/*.jsonl", "format": "jsonl", "prompt_column": "text"},
    "model": {"path": "/models/tiny"},
    "output": {"uri": "s3://bucket/out/"},
}


def with_changes(**sections: Any) -> dict[str, Any]:
    """MINIMAL with some sections merged (a None value removes the key)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in MINIMAL.items()}
    for key, value in sections.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def spec_error(data: Any) -> str:
    with pytest.raises(SpecError) as info:
        parse_job_spec(data, source="job.yaml")
    return str(info.value)


def write_job(tmp_path: Path, data: dict[str, Any] | str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_minimal_job_gets_documented_defaults() -> None:
    spec = parse_job_spec(MINIMAL)
    assert spec.engine.kind == "reference"
    assert spec.sampling.max_tokens == 256 and spec.sampling.temperature == 0.0
    assert spec.limits.max_error_fraction == 0.05
    assert spec.cost.price_per_million is None and spec.cost.budget_usd is None
    assert spec.input.uris == ["s3://bucket/in/*.jsonl"]
    assert spec.model.display_name == "tiny"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"engine": {"kind": "sglang"}},
            "engine.kind: Input should be 'reference', 'trtllm', 'vllm' or 'synthetic'",
        ),
        (
            {"input": {"format": "csv"}},
            "input.format: Input should be 'parquet', 'jsonl', 'openai_batch' or 'ray_data'",
        ),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens: Input should be greater than"),
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature: Input should be a valid"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p: Input should be less than or equal to 1"),
        ({"limits": {"max_error_fraction": 2}}, "limits.max_error_fraction: Input should be"),
        ({"cost": {"batch_discount": 1}}, "cost.batch_discount: Input should be less than 1"),
        ({"cost": {"price_per_million": {"input": -1}}}, "cost.price_per_million.input: Input"),
        ({"cost": {"budget_usd": 0}}, "cost.budget_usd: Input should be greater than 0"),
        ({"output": {"include_token_ids": "maybe"}}, "output.include_token_ids: Input should be"),
        ({"engine": {"kv_cache_tokens": 1}}, "engine.kv_cache_tokens: Input should be greater"),
        ({"name": "bad name!"}, "name: String should match pattern"),
        ({"model": {"path": "/m", "bogus": 1}}, "model.bogus: unknown field"),
        ({"speling": 1}, "speling: unknown field"),
        ({"output": None}, "output: required field is missing"),
        ({"storage": {"endpoint_url": 5}}, "storage.endpoint_url: Input should be a valid string"),
        (
            {"sampling": {"overrides": {"length_penalty": "col"}}},
            "sampling.overrides: unknown sampling.overrides field(s) ['length_penalty']",
        ),
        (
            {"resources": {"num_actors": None, "min_actors": 1}},
            "resources: set num_actors, or both min_actors and max_actors",
        ),
        (
            {"cost": {"prefill_weight": 0, "decode_weight": 0}},
            "cannot both be 0",
        ),
        ({"sampling": {"n": 0}}, "sampling.n: Input should be greater than or equal to 1"),
        ({"sampling": {"prompt_logprobs": 21}}, "sampling.prompt_logprobs: Input should be"),
        (
            {"engine": {"kind": "trtllm"}, "sampling": {"prompt_logprobs": 1}},
            "sampling.prompt_logprobs: engine.kind trtllm does not return",
        ),
    ],
)
def test_errors_name_the_field(changes: dict[str, Any], expected: str) -> None:
    message = spec_error(with_changes(**changes))
    assert message.startswith("job.yaml: invalid job spec")
    assert expected in message


def test_error_shows_the_value_given() -> None:
    message = spec_error(with_changes(engine={"kind": "sglang"}))
    assert "(got 'sglang')" in message


def test_all_problems_reported_at_once() -> None:
    message = spec_error(with_changes(engine={"kind": "x"}, sampling={"max_tokens": -1}))
    assert "(2 problem(s))" in message
    assert "engine.kind" in message and "sampling.max_tokens" in message


@pytest.mark.parametrize(
    ("input_changes", "prompt", "expected"),
    [
        ({"messages_column": "chat"}, None, "set only one of input.prompt_column"),
        ({"prompt_column": None}, None, "no prompt source"),
        (
            {"format": "openai_batch"},
            None,
            "openai_batch takes prompts from body.messages",
        ),
        (
            {"format": "openai_batch", "prompt_column": None},
            {"template": "x {{ a }}"},
            "prompt.template does not apply to input.format openai_batch",
        ),
        (
            {"prompt_column": None, "messages_column": "chat"},
            {"template": "{{ a }}"},
            "remove one of them",
        ),
        (
            {"prompt_column": None, "messages_column": "chat"},
            {"chat_template": False},
            "input.messages_column needs prompt.chat_template: true",
        ),
        ({"passthrough_columns": ["user", "text"]}, None, "['text'] are written by the pipeline"),
        ({}, {"template": "{{ error }}"}, "prompt.template uses ['error']"),
        ({"prompt_column": None}, {"template": "{{ prompt }}"}, "input.prompt_column is not set"),
        ({}, {"template": "{% if %}"}, "prompt.template line 1"),
    ],
)
def test_prompt_source_rules(
    input_changes: dict[str, Any], prompt: dict[str, Any] | None, expected: str
) -> None:
    data = with_changes(input=input_changes)
    data["input"] = {k: v for k, v in data["input"].items() if v is not None}
    if prompt is not None:
        data["prompt"] = prompt
    assert expected in spec_error(data)


def test_template_columns_are_the_template_variables() -> None:
    spec = parse_job_spec(
        with_changes(prompt={"template": "{{ title }}: {{ prompt }} ({{ lang | upper }})"})
    )
    assert spec.template_columns() == ["lang", "title"]
    no_prompt_column = with_changes(prompt={"template": "Translate {{ body }}"})
    del no_prompt_column["input"]["prompt_column"]
    assert parse_job_spec(no_prompt_column).template_columns() == ["body"]


def _every_output_column() -> list[str]:
    """Every column an output part can have, whatever the job asks for (no passthrough)."""
    from pipeline.batch.stages.schema import output_schema

    schema = output_schema(
        include_token_ids=True,
        structured=True,
        logprobs=True,
        speculative=True,
        samples=True,
        prompt_logprobs=True,
    )
    return schema.names


def _every_stage_column() -> list[str]:
    """The columns the read and prompt stages add to a row besides the input's."""
    from pipeline.batch.columns import CORE_COLUMNS, ROW, STAGE_COLUMNS

    return [ROW, *CORE_COLUMNS, *STAGE_COLUMNS]


@pytest.mark.parametrize("column", sorted({*_every_output_column(), *_every_stage_column()}))
def test_a_pipeline_column_cannot_be_passed_through(column: str) -> None:
    message = spec_error(with_changes(input={"passthrough_columns": ["user", column]}))
    assert f"input.passthrough_columns: [{column!r}] are written by the pipeline" in message


@pytest.mark.parametrize("column", ["actor_id", "finished_at", "spec_verifications"])
def test_an_output_column_is_no_template_variable(column: str) -> None:
    message = spec_error(with_changes(prompt={"template": f"{{{{ {column} }}}}"}))
    assert f"prompt.template uses [{column!r}]" in message


def test_non_mapping_document_is_rejected() -> None:
    assert "expected a mapping at the top level, got list" in spec_error([1, 2])


# --- rendering ---------------------------------------------------------------------------------


def test_env_substitution_and_defaults() -> None:
    text = "a: ${BUCKET}\nb: ${MISSING:-fallback}\nc: x${EMPTY:-y}z\n# ${NOT_SET_IN_COMMENT}\n"
    data = load_yaml(text, source="job.yaml", env={"BUCKET": "nightly", "EMPTY": ""})
    # Set-but-empty wins over the default, as in the shell.
    assert data == {"a": "nightly", "b": "fallback", "c": "xz"}


def test_unset_env_var_is_an_error_naming_it() -> None:
    with pytest.raises(SpecError, match=r"job.yaml: a: environment variable \$\{NOPE\} is not set"):
        load_yaml("a: ${NOPE}", source="job.yaml", env={})
    with pytest.raises(SpecError, match=r"job.yaml: a.b\[1\]: environment variable \$\{NOPE\}"):
        load_yaml("a: {b: [x, '${NOPE}']}", source="job.yaml", env={})


def test_a_variable_in_an_alias_is_substituted_once() -> None:
    # The value of X holds a reference of its own: it stays as it is, where the anchor stands
    # and where the alias repeats it.
    data = load_yaml("a: &v ${X}\nb: *v\n", source="job.yaml", env={"X": "${X}!"})
    assert data == {"a": "${X}!", "b": "${X}!"}


def test_a_reference_works_wherever_a_value_can_stand() -> None:
    # Flow collections (whose braces and commas a bare `${...}` would break), keys, block
    # scalars, several references in one value.
    text = "a: {b: ${X}, c: [${X}, x${Y}y]}\n${K}: 1\nd: |\n  ${X} and ${Y}\n"
    data = load_yaml(text, source="job.yaml", env={"X": "1", "Y": "}, z: {", "K": "gpu"})
    assert data == {"a": {"b": 1, "c": [1, "x}, z: {y"]}, "gpu": 1, "d": "1 and }, z: {\n"}


def test_a_yaml_error_shows_the_references_as_written() -> None:
    with pytest.raises(SpecError) as info:
        load_yaml("a: [${X}, ${Y:-y}\nb: 1\n", source="job.yaml", env={})
    assert str(info.value) == (
        "job.yaml: not valid YAML at line 2, column 2: while parsing a flow sequence: expected "
        "',' or ']', but got ':'\n  b: 1\n   ^"
    )
    with pytest.raises(SpecError) as info:
        load_yaml("a: ${X}: ${Y}\n", source="job.yaml", env={})
    assert str(info.value) == (
        "job.yaml: not valid YAML at line 1, column 8: mapping values are not allowed here\n"
        "  a: ${X}: ${Y}\n         ^"
    )


def test_env_references_are_the_names_values_use() -> None:
    text = "a: ${ONE}\nb: [x, '${TWO:-2}-${ONE}']\n# ${IN_COMMENT}\nc: 1  # ${TRAILING}\n"
    assert env_references(text) == ["ONE", "TWO"]
    assert env_references("a: [unclosed") == []


# `${VAR}` goes into one value of the parsed file, never into its text: whatever the variable
# holds, the file keeps its shape and the field gets exactly that text.
_JOB_WITH_SYSTEM_PROMPT = """\
name: job-1
input: {uri: s3://bucket/in/*.jsonl, format: jsonl, prompt_column: text}
model: {path: /models/tiny}
prompt:
  system_prompt: ${SYSTEM}
output: {uri: s3://bucket/out/}
"""
_TRICKY_VALUES = {
    "colon-space": "Answer: yes or no",
    "leading-quote": '"Hello" is how you greet',
    "newline-adds-a-key": "Be brief.\nengine:\n  kind: vllm",
    "hash": "Use C# # and nothing else",
    "flow-mapping": "{be: brief}",
    "flow-sequence": "[1, 2]",
    "dash": "- one item",
}


@pytest.mark.parametrize("value", _TRICKY_VALUES.values(), ids=_TRICKY_VALUES.keys())
def test_a_variable_is_one_value_whatever_it_holds(tmp_path: Path, value: str) -> None:
    path = write_job(tmp_path, _JOB_WITH_SYSTEM_PROMPT)
    spec = load_job_spec(path, env={"SYSTEM": value})
    assert spec.prompt.system_prompt == value
    assert spec.engine.kind == "reference"  # no key came in with the value


def _serve_file(tmp_path: Path) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "models:\n"
        "  - name: m\n"
        "    model: {path: /models/tiny}\n"
        "    prompt: {system_prompt: ${SYSTEM}}\n"
    )
    return path


def _quantize_file(tmp_path: Path) -> Path:
    path = tmp_path / "quantize.yaml"
    path.write_text(
        "name: q\n"
        "model: ${SYSTEM}\n"
        "quantization: {format: fp8, calibration: {source: /data/cal.parquet}}\n"
        "output: /out\n"
    )
    return path


def _load_serve(path: Path, env: dict[str, str]) -> str | None:
    from pipeline.serve.spec import load_serve_spec

    return load_serve_spec(path, env=env).models[0].prompt.system_prompt


def _load_quantize(path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    from pipeline.cli.quantize_cmds import load_quantize_spec

    for name, value in env.items():  # this loader reads os.environ
        monkeypatch.setenv(name, value)
    return load_quantize_spec(path, []).model


@pytest.mark.parametrize("loader", ["serve", "quantize"])
def test_every_loader_substitutes_into_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader: str
) -> None:
    value = _TRICKY_VALUES["newline-adds-a-key"] + ': "x"'
    if loader == "serve":
        assert _load_serve(_serve_file(tmp_path), {"SYSTEM": value}) == value
    else:
        assert _load_quantize(_quantize_file(tmp_path), {"SYSTEM": value}, monkeypatch) == value


def test_an_unset_variable_names_the_field(tmp_path: Path) -> None:
    path = write_job(tmp_path, _JOB_WITH_SYSTEM_PROMPT)
    with pytest.raises(SpecError) as info:
        load_job_spec(path, env={})
    assert str(info.value) == (
        f"{path}: prompt.system_prompt: environment variable ${{SYSTEM}} is not set "
        "(export it, or write ${SYSTEM:-default})"
    )


def test_a_variable_in_a_comment_is_not_substituted(tmp_path: Path) -> None:
    text = _JOB_WITH_SYSTEM_PROMPT.replace("${SYSTEM}", "Be brief.  # was ${OLD_SYSTEM}")
    spec = load_job_spec(write_job(tmp_path, text), env={})
    assert spec.prompt.system_prompt == "Be brief."


def test_a_variable_is_typed_as_yaml_types_the_value_where_it_stands(tmp_path: Path) -> None:
    """Unquoted: YAML's own types for a plain value (number, true/false, null), as if the value
    were written there. Quoted: text, which the schema converts for a number field."""
    text = """\
name: job-1
input: {uri: s3://bucket/in/*.jsonl, format: jsonl, prompt_column: text}
model: {path: /models/tiny}
output: {uri: "s3://${BUCKET}/out/", include_token_ids: ${FLAG}}
resources: {num_actors: ${ACTORS}}
sampling: {temperature: ${TEMPERATURE}, max_tokens: "${MAX_TOKENS}", seed: ${SEED:-}}
engine:
  max_model_len: ${UNSET_LEN:-}
  extra: {max_num_seqs: ${ACTORS}, label: "${ACTORS}"}
"""
    env = {
        "BUCKET": "nightly",
        "FLAG": "true",
        "ACTORS": "3",
        "TEMPERATURE": "0.5",
        "MAX_TOKENS": "64",
        "SEED": "",  # set but empty: the value is empty (null), as in the shell
    }
    spec = load_job_spec(write_job(tmp_path, text), env=env)
    assert spec.output.uri == "s3://nightly/out/"
    assert spec.output.include_token_ids is True
    assert spec.resources.num_actors == 3
    assert spec.sampling.temperature == 0.5 and spec.sampling.max_tokens == 64
    assert spec.sampling.seed is None and spec.engine.max_model_len is None
    # extra goes to the engine as it is: the types YAML gave the values are the ones it gets.
    assert spec.engine.extra == {"max_num_seqs": 3, "label": "3"}


def test_bad_date_is_an_error() -> None:
    with pytest.raises(SpecError, match="date '2026-13-01' is not YYYY-MM-DD"):
        load_yaml("a: 1", source="job.yaml", date="2026-13-01", env={})


def test_date_templating_precedence(tmp_path: Path) -> None:
    data = with_changes(output={"uri": "s3://bucket/out/{{ date }}/"})
    path = write_job(tmp_path, data)
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert load_job_spec(path, env={}).output.uri == f"s3://bucket/out/{today}/"
    assert load_job_spec(path, env={}).date == today

    dated = write_job(tmp_path, {**data, "date": "2026-03-04"})
    assert load_job_spec(dated, env={}).output.uri == "s3://bucket/out/2026-03-04/"
    # --set date beats the file, --date beats both.
    spec = load_job_spec(dated, overrides=["date=2026-05-06"], env={})
    assert spec.output.uri == "s3://bucket/out/2026-05-06/" and spec.date == "2026-05-06"
    spec = load_job_spec(dated, overrides=["date=2026-05-06"], date="2027-01-01", env={})
    assert spec.output.uri == "s3://bucket/out/2027-01-01/"


def test_invalid_date_in_file_is_reported(tmp_path: Path) -> None:
    path = write_job(tmp_path, {**MINIMAL, "date": "tomorrow"})
    with pytest.raises(SpecError, match="date: 'tomorrow' is not YYYY-MM-DD"):
        load_job_spec(path, env={})


def test_set_overrides_parse_yaml_values(tmp_path: Path) -> None:
    path = write_job(tmp_path, MINIMAL)
    spec = load_job_spec(
        path,
        overrides=[
            "sampling.max_tokens=64",
            "sampling.temperature=0.5",
            "output.include_token_ids=true",
            "input.passthrough_columns=[user, lang]",
            "engine.kind=trtllm",
            "output.uri=s3://b/runs/{{ date }}",
        ],
        date="2026-02-03",
        env={},
    )
    assert spec.sampling.max_tokens == 64 and spec.sampling.temperature == 0.5
    assert spec.output.include_token_ids is True
    assert spec.input.passthrough_columns == ["user", "lang"]
    assert spec.engine.kind == "trtllm"
    assert spec.output.uri == "s3://b/runs/2026-02-03"


def test_set_errors_name_the_override(tmp_path: Path) -> None:
    path = write_job(tmp_path, MINIMAL)
    with pytest.raises(SpecError, match=r"expected key\.path=value"):
        load_job_spec(path, overrides=["sampling.max_tokens"], env={})
    with pytest.raises(SpecError, match="'name' is not a section"):
        load_job_spec(path, overrides=["name.x=1"], env={})
    with pytest.raises(SpecError, match="value is not valid YAML"):
        load_job_spec(path, overrides=["sampling.stop=[a,"], env={})
    with pytest.raises(SpecError, match=r"sampling\.max_toknes: unknown field"):
        load_job_spec(path, overrides=["sampling.max_toknes=3"], env={})


def test_apply_overrides_creates_sections() -> None:
    data = apply_overrides({"name": "x"}, ["limits.max_error_fraction=0.1"])
    assert data["limits"] == {"max_error_fraction": 0.1}


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read job file"):
        load_job_spec(tmp_path / "nope.yaml")
    bad = write_job(tmp_path, "name: [unclosed\n")
    with pytest.raises(SpecError, match=f"{bad}: not valid YAML"):
        load_job_spec(bad, env={})
    wrong = write_job(tmp_path, with_changes(engine={"kind": "x"}))
    with pytest.raises(SpecError, match=rf"{wrong}: invalid job spec"):
        load_job_spec(wrong, env={})


def test_spec_round_trips_through_json() -> None:
    spec = parse_job_spec(with_changes(cost={"price_per_million": {"input": 1, "output": 2}}))
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


# --- docs ----------------------------------------------------------------------------------------


def test_job_spec_doc_is_fresh() -> None:
    committed = docgen.DOC_PATH.read_text() if docgen.DOC_PATH.exists() else ""
    assert committed == docgen.render(), "docs/job-spec.md is stale: python -m pipeline.spec.docgen"


def test_doc_lists_every_field() -> None:
    text = docgen.render()
    for path in (
        "input.uri",
        "input.format",
        "input.id_column",
        "sampling.max_tokens",
        "output.include_token_ids",
        "storage.endpoint_url",
        "limits.max_error_fraction",
        "cost.device_hour_usd",
        "cost.price_per_million.cached_input",
        "cost.batch_discount",
        "cost.budget_usd",
        "engine.expected_tokens_per_s",
    ):
        assert f"`{path}`" in text


def test_an_empty_job_file_says_it_is_empty(tmp_path: Path) -> None:
    from pipeline.spec import load_job_spec

    for text in ("", "# only a comment\n", "\n\n"):
        path = tmp_path / "job.yaml"
        path.write_text(text)
        with pytest.raises(SpecError, match=r"job.yaml: the job file is empty; a job needs"):
            load_job_spec(path)
