"""Models and adapters on the Hugging Face Hub: `hf://ORG/NAME` or `hf://ORG/NAME@REVISION`
(a branch, tag or commit; default main) wherever a model, tokenizer or adapter folder is named.

Downloads go through huggingface_hub's snapshot_download into `<cache_dir>/hub`, once per
node (its cache locks a file while one process fetches it, and keeps each commit's snapshot
apart). The endpoint is HF_ENDPOINT (default the public hub; a mirror or a private hub
otherwise) and the token HF_TOKEN, both from the environment, never from a job file. A job's
fingerprint takes the revision's commit and file sizes from the hub's API without
downloading anything, so a moved branch is a new job while the same commit resumes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pipeline.spec import SpecError

SCHEME = "hf://"
# org/name (or a bare name), each part as the hub allows; then an optional @revision.
_REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<rev>[^\s@]+))?$")


def is_hub(uri: str) -> bool:
    return uri.startswith(SCHEME)


def parse(uri: str, field: str) -> tuple[str, str]:
    """(repo id, revision) of an hf:// source; SpecError naming `field` when it is not one."""
    match = _REPO.match(uri[len(SCHEME) :])
    if match is None:
        raise SpecError(
            f"{field}: {uri!r} is not a Hugging Face Hub source; write hf://ORG/NAME or "
            "hf://ORG/NAME@REVISION"
        )
    return match["repo"], match["rev"] or "main"


def _endpoint() -> str | None:
    # Read here, not at import: huggingface_hub reads HF_ENDPOINT once, when first imported.
    return os.environ.get("HF_ENDPOINT") or None


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _problem(uri: str, field: str, exc: Exception) -> SpecError:
    where = _endpoint() or "the public hub (set HF_ENDPOINT for a mirror)"
    hint = (
        "check the name and revision; a gated or private repository needs HF_TOKEN in the "
        "environment of every node"
    )
    return SpecError(
        f"{field}: cannot read {uri} from {where}: {type(exc).__name__}: {exc}; {hint}"
    )


def snapshot(
    uri: str,
    cache_dir: str,
    field: str,
    required_file: str,
    patterns: tuple[str, ...] | None = None,
) -> Path:
    """The local snapshot of `uri` (only `patterns` and `required_file` when patterns are
    given), downloaded into cache_dir once per node."""
    from huggingface_hub import snapshot_download

    repo, revision = parse(uri, field)
    allow = None if patterns is None else [required_file, *patterns]
    try:
        local = snapshot_download(
            repo,
            revision=revision,
            cache_dir=str(Path(os.path.expanduser(cache_dir)) / "hub"),
            allow_patterns=allow,
            endpoint=_endpoint(),
            token=_token(),
        )
    except Exception as exc:
        raise _problem(uri, field, exc) from None
    path = Path(local)
    if not (path / required_file).is_file():
        raise SpecError(f"{field}: {uri} has no {required_file}; is it the right repository?")
    return path


def content(uri: str, field: str, required_file: str) -> dict[str, Any]:
    """The revision's commit and (name, size) of every file, from the hub's API: what a job's
    fingerprint records for a hub source."""
    from huggingface_hub import HfApi

    repo, revision = parse(uri, field)
    try:
        info = HfApi(endpoint=_endpoint(), token=_token()).model_info(
            repo, revision=revision, files_metadata=True
        )
    except Exception as exc:
        raise _problem(uri, field, exc) from None
    files = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    if required_file not in files:
        raise SpecError(f"{field}: {uri} has no {required_file}; is it the right repository?")
    return {"commit": info.sha, "files": dict(sorted(files.items()))}
