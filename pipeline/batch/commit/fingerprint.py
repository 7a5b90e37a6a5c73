"""The job fingerprint: what must stay the same for rows from two runs to belong together.

A resumed run appends rows to the ones already committed, so both runs must have produced
their rows the same way. The fingerprint hashes, per component:

- model:    the path, plus a cheap content fingerprint (config.json's bytes and every file's
            name and size; hashing multi-GB weights on every run would cost minutes), and
            with model.adapters each adapter's source and the same fingerprint of its folder,
- engine:   the engine kind and the settings passed to the engine,
- sampling: the whole sampling section (defaults, stops, per-row override columns),
- prompt:   template, system prompt, chat-template flag, and the input columns read,
- input:    the listing of input files (uri, size, version / etag / mtime when known), the row
            limit and the shard plan (rows are tracked per shard, so a rerun must cut the same
            shards),
- output:   the output schema (passthrough columns with their types) and whether token ids
            are written: parts of one output share one schema.

Resources, limits, output layout and prices are left out on purpose: changing the actor count
or the price of an hour does not change what a row says.

Each component is hashed on its own so a refusal can name what changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipeline.engine_setup import engine_settings
from pipeline.spec import JobSpec, SpecError, StorageSpec
from pipeline.storage import filesystem_for, hub
from pipeline.storage.hub import is_hub

COMPONENTS = ("model", "engine", "sampling", "prompt", "input", "output")


@dataclass(frozen=True)
class Fingerprint:
    """The job's hash and the per-component hashes it is made of."""

    value: str  # sha256 over the component hashes, in COMPONENTS order
    components: dict[str, str]  # component name -> sha256 of its canonical JSON

    def changed_components(self, other: Fingerprint) -> list[str]:
        """Components whose hashes differ (all of them if `other` lacks one)."""
        return [c for c in COMPONENTS if self.components.get(c) != other.components.get(c)]

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "components": dict(self.components)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(value=str(data["value"]), components=dict(data.get("components", {})))


def canonical_hash(obj: Any) -> str:
    """sha256 of `obj` as sorted, compact JSON (dict order and whitespace do not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def input_listing(files: Iterable[Any]) -> list[dict[str, Any]]:
    """Plain dicts of the pre-flight's InputFile records, sorted by uri."""
    rows = []
    for item in files:
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            row = dataclasses.asdict(item)
        elif hasattr(item, "model_dump"):
            row = item.model_dump()
        elif isinstance(item, dict):
            row = dict(item)
        else:
            row = {"uri": str(item)}
        rows.append(row)
    return sorted(rows, key=lambda r: str(r.get("uri", r)))


def model_content(path: str, storage: StorageSpec) -> dict[str, Any]:
    """config.json's hash plus (name, size) of every file under the model directory (a hub
    source: its revision's commit and file sizes, from the hub's API)."""
    if is_hub(path):
        return hub.content(path, "model.path", "config.json")

    fs, root = filesystem_for(path, storage)
    root = root.rstrip("/")
    try:
        entries = fs.find(root, detail=True)
    except OSError as exc:
        raise SpecError(f"model.path: cannot list {path}: {exc}") from None
    sizes = {}
    config_hash = None
    for name, info in sorted(entries.items()):
        rel = name[len(root) + 1 :]
        sizes[rel] = int(info.get("size") or 0)
        if rel == "config.json":
            config_hash = hashlib.sha256(fs.cat_file(name)).hexdigest()
    if config_hash is None:
        raise SpecError(
            f"model.path: {path} has no config.json; point it at a Hugging Face model directory"
        )
    return {"config_sha256": config_hash, "files": sizes}


def adapter_content(source: str, storage: StorageSpec) -> dict[str, Any]:
    """adapter_config.json's hash and (name, size) of every file of an adapter folder. One
    that cannot be read is recorded as such: its rows fail, the job does not."""
    if is_hub(source):
        try:
            return hub.content(source, "model.adapters", "adapter_config.json")
        except SpecError as exc:
            return {"unreadable": str(exc)}
    fs, root = filesystem_for(source, storage)
    root = root.rstrip("/")
    try:
        entries = fs.find(root, detail=True)
        sizes = {
            name[len(root) + 1 :]: int(info.get("size") or 0) for name, info in entries.items()
        }
        config = f"{root}/adapter_config.json"
        digest = hashlib.sha256(fs.cat_file(config)).hexdigest() if config in entries else None
    except OSError as exc:
        return {"unreadable": f"{type(exc).__name__}"}
    return {"config_sha256": digest, "files": dict(sorted(sizes.items()))}


def _sampling_part(spec: JobSpec) -> dict[str, Any]:
    sampling = spec.sampling.model_dump(mode="json")
    # Fields added later count only when set, so outputs written before they existed keep
    # their fingerprint (and resume) unless the job asks for the new feature.
    for name, default in (("n", 1), ("prompt_logprobs", None)):
        if sampling.get(name) == default:
            sampling.pop(name, None)
    return sampling


# Prompt fields that joined the fingerprint later: present only when set, so the fingerprints
# of jobs that do not use them stay what they were (a running job resumes across an upgrade).
_PROMPT_FIELDS_WHEN_SET = (
    "reasoning",
    "enable_thinking",
    "reasoning_effort",
    "tool_parser",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "images",
)


def _prompt_part(spec: JobSpec) -> dict[str, Any]:
    prompt = spec.prompt.model_dump(mode="json")
    fields = type(spec.prompt).model_fields
    for name in _PROMPT_FIELDS_WHEN_SET:
        default = fields[name].get_default(call_default_factory=True)
        if hasattr(default, "model_dump"):
            default = default.model_dump(mode="json")
        if prompt[name] == default:
            del prompt[name]
    return prompt


def job_fingerprint(
    spec: JobSpec,
    files: Iterable[Any],
    model_info: dict[str, Any] | None = None,
    *,
    shard_plan: str = "",
    schema: list[list[str]] | None = None,
) -> Fingerprint:
    """Fingerprint a job from its spec, its pre-flight listing, the model's content, the shard
    plan's digest and the output schema (pipeline.batch.stages.schema.schema_to_json)."""

    if model_info is None:
        model_info = model_content(spec.model.path, spec.storage)
    model_part: dict[str, Any] = {
        "path": spec.model.path,
        "tokenizer": spec.model.tokenizer,
        **model_info,
    }
    if spec.model.adapters:  # only when set: other jobs keep the fingerprint they had
        model_part["adapters"] = {
            name: {"source": source, **adapter_content(source, spec.storage)}
            for name, source in sorted(spec.model.adapters.items())
        }
    if spec.model.adapter_prefix:
        # The place only: which names a run reads from it is known when its rows run.
        model_part["adapter_prefix"] = spec.model.adapter_prefix
    if spec.model.quantization is not None:
        # Added only when set, so fingerprints of unquantized jobs stay what they were; an fp8
        # job and an nvfp4 job on the same source model must never share output.
        model_part["quantization"] = spec.model.quantization.model_dump(mode="json")
    parts: dict[str, Any] = {
        "model": model_part,
        "engine": {"kind": spec.engine.kind, "settings": engine_settings(spec.engine)},
        "sampling": _sampling_part(spec),
        "prompt": {
            **_prompt_part(spec),
            "format": spec.input.format,
            "id_column": spec.input.id_column,
            "prompt_column": spec.input.prompt_column,
            "messages_column": spec.input.messages_column,
            **({"adapter_column": spec.input.adapter_column} if spec.input.adapter_column else {}),
            **({"image_columns": spec.input.image_columns} if spec.input.image_columns else {}),
        },
        "input": {
            "files": input_listing(files),
            "limit": spec.input.limit,
            "shard_plan": shard_plan,
        },
        "output": {
            "schema": schema,
            "passthrough_columns": spec.input.passthrough_columns,
            "include_token_ids": spec.output.include_token_ids,
        },
    }
    components = {name: canonical_hash(parts[name]) for name in COMPONENTS}
    value = canonical_hash([components[name] for name in COMPONENTS])
    return Fingerprint(value=value, components=components)
