"""Loading a job file: read text → `{{ date }}` templating → YAML → `${ENV_VAR}` substitution in
the parsed values → `--set a.b=c` overrides → validation. See `load_job_spec` and `load_yaml`
(which serve and quantize files use too)."""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.spec.base import SpecError, format_validation_error
from pipeline.spec.job import JobSpec

_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_DATE_TAG = re.compile(r"\{\{\s*date\s*\}\}")


def today_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def render_date(text: str, date: str | None = None, source: str = "job file") -> str:
    """`{{ date }}` in the text becomes the run date (default today, UTC).

    Done on the text, before parsing, because `key: {{ date }}` is not valid YAML until then;
    a checked YYYY-MM-DD cannot change the file's shape (an environment value can, which is why
    `${VAR}` goes into parsed values instead: see `load_yaml`)."""
    run_date = date or today_utc()
    try:
        dt.date.fromisoformat(run_date)
    except ValueError:
        raise SpecError(f"{source}: date {run_date!r} is not YYYY-MM-DD") from None
    return _DATE_TAG.sub(run_date, text)


class _EnvLoader(yaml.SafeLoader):
    """PyYAML's safe loader that keeps how YAML typed each scalar: `implicit[id(node)]` holds
    the (plain, quoted) flags of a scalar whose tag was inferred; a scalar with a tag written in
    the file (`!!str`) has none. A substituted value is typed again from them, as if it had
    been written there."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.implicit: dict[int, tuple[bool, bool]] = {}

    def compose_scalar_node(self, anchor: str | None) -> yaml.ScalarNode:
        event = self.peek_event()
        node = super().compose_scalar_node(anchor)
        if event.tag in (None, "!"):
            self.implicit[id(node)] = event.implicit
        return node


class _Parsed:
    """A file's YAML node tree, each `${...}` in it standing as a plain word until substituted.

    The words exist because `${...}` is not valid everywhere a value may be written: in
    `model: {path: ${MODEL}}` its braces would end the flow mapping. Each reference becomes
    `<marker><n>_`, a word that is a plain scalar (or part of one) wherever the reference stood,
    and is replaced in the parsed values by what the reference gives."""

    def __init__(self, text: str, source: str) -> None:
        # Per reference: the `${...}` text, the variable's name, its default (None: none).
        self.references: list[tuple[str, str, str | None]] = []
        self._marker = f"tokenmill{os.urandom(6).hex()}ref"
        self._word = re.compile(rf"{self._marker}(\d+)_")

        def stand_in(match: re.Match[str]) -> str:
            self.references.append((match.group(0), match.group(1), match.group(2)))
            return f"{self._marker}{len(self.references) - 1}_"

        text = _ENV_VAR.sub(stand_in, text)
        self._lines = text.splitlines()
        try:
            self.loader = _EnvLoader(text)  # the reader refuses control characters here
            self.root: yaml.Node | None = self.loader.get_single_node()
        except yaml.YAMLError as exc:
            raise self._error(exc, source) from None
        self.loader.dispose()  # the parser's state; the tree and the constructor stay

    def _as_written(self, text: str) -> str:
        return self._word.sub(lambda m: self.references[int(m.group(1))][0], text)

    def _error(self, exc: yaml.YAMLError, source: str) -> SpecError:
        """The YAML error with the line as the file wrote it (PyYAML quotes the text it read,
        cut to a window that can end inside a stand-in)."""
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None)
        if mark is None or not problem or not 0 <= mark.line < len(self._lines):
            return SpecError(f"{source}: not valid YAML: {self._as_written(str(exc))}")
        line = self._lines[mark.line]
        column = len(self._as_written(line[: mark.column]))
        what = ": ".join(str(t) for t in (getattr(exc, "context", None), problem) if t)
        return SpecError(
            f"{source}: not valid YAML at line {mark.line + 1}, column {column + 1}: {what}\n"
            f"  {self._as_written(line)}\n  {' ' * column}^"
        )

    def names(self) -> list[str]:
        """Variable names the file's keys and values use (comments are gone), sorted."""
        found: set[str] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, yaml.MappingNode):
                stack += [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value
            elif isinstance(node, yaml.ScalarNode):
                found.update(self.references[int(n)][1] for n in self._word.findall(node.value))
        return sorted(found)

    def substitute(self, env: dict[str, str], source: str) -> Any:
        """The file's data, each reference replaced by its variable (or default)."""
        if self.root is None:
            return None
        self._substitute(self.root, env, source, "", set())
        try:
            return self.loader.construct_document(self.root)
        except yaml.YAMLError as exc:  # e.g. a tag the safe loader does not know
            raise self._error(exc, source) from None

    def _substitute(
        self, node: yaml.Node, env: dict[str, str], source: str, path: str, done: set[int]
    ) -> None:
        if id(node) in done:  # an alias: substituted where its anchor stands
            return
        done.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                self._substitute(key, env, source, path, done)
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                self._substitute(value, env, source, f"{path}.{name}" if path else name, done)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._substitute(item, env, source, f"{path}[{i}]", done)
        elif isinstance(node, yaml.ScalarNode) and self._marker in node.value:

            def value_of(match: re.Match[str]) -> str:
                _, name, default = self.references[int(match.group(1))]
                if name in env:
                    return env[name]
                if default is not None:
                    return default
                raise SpecError(
                    f"{source}: {path or '(top level)'}: environment variable ${{{name}}} is "
                    f"not set (export it, or write ${{{name}:-default}})"
                )

            node.value = self._word.sub(value_of, node.value)
            if id(node) in self.loader.implicit:
                implicit = self.loader.implicit[id(node)]
                node.tag = self.loader.resolve(yaml.ScalarNode, node.value, implicit)


def load_yaml(
    text: str,
    *,
    source: str,
    date: str | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """A job, serve or quantize file's data: `{{ date }}` in the text (`render_date`), then
    YAML, then `${VAR}` / `${VAR:-default}` from `env` (default os.environ) in the parsed values.

    Substituting into parsed values keeps a variable one value whatever it holds (`: `, quotes,
    `#`, brackets, newlines), and leaves comments alone. Types: a substituted value is typed as
    YAML types that text written in the same place. Unquoted (`num_actors: ${N}`) it gets
    YAML's scalar types (N=4 is the integer 4, `true` a boolean, an empty value null), never a
    list or a mapping; quoted (`"${N}"`) or a block scalar, it is text, which the schema then
    converts where the field is a number or a boolean (the specs validate in pydantic's lax
    mode). So a value the schema takes as text and YAML would not (`no`, `1.10`) is quoted."""
    env = dict(os.environ) if env is None else env
    return _Parsed(render_date(text, date, source), source).substitute(env, source)


def env_references(text: str) -> list[str]:
    """The `${VAR}` names a file's values use (what it needs from the environment), sorted;
    none for a file that is not valid YAML."""
    try:
        return _Parsed(render_date(text), "").names()
    except SpecError:
        return []


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars (`3`, `true`, `[1,2]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key.path=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    return data


def parse_job_spec(data: Any, source: str = "job spec") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, source)) from None


def load_job_spec(
    path: str | Path,
    overrides: list[str] | None = None,
    date: str | None = None,
    env: dict[str, str] | None = None,
) -> JobSpec:
    """Read, render and validate a job file. Raises SpecError with the file and field path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read job file {path}: {exc.strerror or exc}") from None
    # The run date feeds `{{ date }}`, so it is settled before rendering. Precedence:
    # --date, then --set date=..., then a top-level `date:` in the file, then today (UTC).
    overrides = list(overrides or [])
    if date is None:
        for item in overrides:
            key, _, value = item.partition("=")
            if key.strip() == "date" and value.strip():
                date = value.strip().strip("'\"")
    if date is None:
        match = re.search(r"^date:\s*['\"]?(\d{4}-\d{2}-\d{2})", text, re.MULTILINE)
        date = match.group(1) if match else None
    run_date = date or today_utc()
    data = load_yaml(text, source=str(path), date=run_date, env=env)
    if data is None:
        raise SpecError(
            f"{path}: the job file is empty; a job needs at least name, input, model and output "
            "(see docs/job-spec.md or jobs/demo.yaml)"
        )
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    file_date = data.get("date")
    if file_date is not None and not isinstance(file_date, dt.date):
        try:
            dt.date.fromisoformat(str(file_date))
        except ValueError:
            raise SpecError(f"{path}: date: {file_date!r} is not YYYY-MM-DD") from None
    # `{{ date }}` in a --set value (e.g. an output prefix) gets the same run date.
    rest = [_DATE_TAG.sub(run_date, o) for o in overrides if o.partition("=")[0].strip() != "date"]
    data = apply_overrides(data, rest)
    data["date"] = run_date
    return parse_job_spec(data, source=str(path))
