"""A batch's pipeline job: its id on Ray (fixed per batch, so a lost answer can be looked up and
a second submit is refused), the job spec built from the served model's batch template, and
the subset of Ray's Jobs API the Batch API uses."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, Protocol

from pipeline.batch.interface.batch_api import EMBEDDINGS_URL
from pipeline.serve.batch_api.files import MAX_REPORTED_ERRORS, BatchInputSummary, InputError
from pipeline.serve.spec import ServedModelSpec, ServeSpec

JOB_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# A record saved before its job was submitted whose job Ray does not know this long after it
# was created: the ingress died between the two, so the batch fails (it can be resumed).
SUBMIT_GRACE_S = 300
# Batch ids start with the creation time counted down (milliseconds before 2^44 ms, 11 hex
# digits) and end with 16 random hex digits, so the store's name order is newest first and a
# list page reads only its own records.
_ID_RE = re.compile(r"batch_[0-9a-f]{11}[0-9a-f]{16}")


class JobsApi(Protocol):
    """The subset of ray.job_submission.JobSubmissionClient used here (tests fake it)."""

    def submit_job(self, **kwargs: Any) -> str: ...

    def get_job_info(self, job_id: str) -> Any: ...

    def stop_job(self, job_id: str) -> bool: ...


def submission_id(batch_id: str) -> str:
    return f"tokenmill-{batch_id}"


def new_batch_id(created_ms: int) -> str:
    """A batch id whose name order is newest first (see _ID_RE)."""
    countdown = (1 << 44) - 1 - created_ms
    return f"batch_{countdown:011x}{os.urandom(8).hex()}"


def batch_created_s(batch_id: str) -> float | None:
    """When a batch was created, from its id (None for ids from before ids carried it)."""
    if _ID_RE.fullmatch(batch_id) is None:
        return None
    return ((1 << 44) - 1 - int(batch_id[6:17], 16)) / 1000


def list_order(batch_id: str) -> tuple[bool, str]:
    # Ids from before ids carried their time come after the rest, in no particular order.
    return (_ID_RE.fullmatch(batch_id) is None, batch_id)


def job_spec_data(
    batch_id: str,
    served: ServedModelSpec,
    spec: ServeSpec,
    input_uri: str,
    output_uri: str,
    expires_at: float | None = None,
    endpoint: str = "/v1/chat/completions",
) -> dict[str, Any]:
    """The pipeline job of a batch: the served model's sections, its batch template, the
    uploaded file in and OpenAI-format files out; the job stops itself at `expires_at`."""
    template = served.batch
    assert template is not None
    engine = template.engine or served.engine
    # Name rows after the served model, so response bodies say what a client sent.
    model = served.model.model_copy(update={"name": served.name})
    if endpoint == EMBEDDINGS_URL:
        # Adapters apply to generation: an embeddings batch runs the model itself (a line
        # naming an adapter was refused while validating).
        model = model.model_copy(update={"adapters": {}})
        # Texts embedded as given (no chat template); nothing is sampled.
        task: dict[str, Any] = {
            "task": "embed",
            "prompt": {**served.prompt.model_dump(mode="json"), "chat_template": False},
            "sampling": {},
        }
    else:
        # A body without temperature samples at 1, as the same request sent to the endpoint
        # (and to OpenAI) does; the job's own default is greedy.
        task = {
            "prompt": served.prompt.model_dump(mode="json"),
            "sampling": {"max_tokens": template.max_tokens, "temperature": 1.0},
        }
    return {
        "name": batch_id,
        "input": {
            "uri": input_uri,
            "format": "openai_batch",
            "passthrough_columns": ["url"],  # picks chat.completion or text_completion
        },
        **task,
        "model": model.model_dump(mode="json"),
        "engine": engine.model_dump(mode="json"),
        "resources": template.resources.model_dump(mode="json"),
        # Parts written and committed often, so request_counts move while the batch runs and
        # a cancel loses little.
        "output": {
            "uri": output_uri,
            "format": "openai_batch",
            "flush_interval_s": 10.0,
            "commit_interval_s": 5.0,
        },
        "storage": spec.storage.model_dump(mode="json"),
        # A failed request is an error line, never a failed batch. At the end of the window
        # the job stops itself and commits what finished, whether or not anyone reads the
        # batch then (a read past the window stops it too, in case the job could not).
        "limits": {"max_error_fraction": 1.0, "stop_at": expires_at},
        "cost": served.cost.model_copy(
            update={"batch_discount": template.batch_discount, "budget_usd": None}
        ).model_dump(mode="json"),
    }


def job_status(info: Any) -> str:
    """A Ray job's status as the Jobs API spells it (PENDING, RUNNING, SUCCEEDED, ...)."""
    return str(getattr(info.status, "value", info.status))


def input_errors(
    spec: ServeSpec, summary: BatchInputSummary, endpoint: str, allows: Callable[[str], bool]
) -> tuple[list[InputError], ServedModelSpec | None]:
    """What fails this batch during validating (the file's own problems, then this
    batch's: lines whose url is not its endpoint, models it cannot run), at most
    MAX_REPORTED_ERRORS in line order; and the model when there is nothing."""
    errors = list(summary.errors)
    for url, lines in summary.urls.items():
        if url != endpoint:
            message = f"The url {url!r} of this request is not the batch's endpoint {endpoint!r}."
            errors += [InputError("url_mismatch", message, n, "url") for n in lines]
    chosen: ServedModelSpec | None = None  # the first model it can run
    for name, lines in summary.models.items():
        served = served_for_batches(spec, name, allows)
        if not isinstance(served, str) and endpoint == EMBEDDINGS_URL and name != served.name:
            served = (
                f"The model '{name}' is a LoRA adapter of '{served.name}'; adapters apply to "
                f"generation: embeddings lines name '{served.name}'."
            )
        if isinstance(served, str):
            errors += [InputError("model_not_found", served, n, "body.model") for n in lines]
        elif chosen is None:
            chosen = served
        elif served.name != chosen.name:
            message = (
                f"This request names the model {name!r}, an earlier one {chosen.name!r}; a "
                "batch runs one model (and its adapters): split the file by body.model."
            )
            errors += [InputError("model_mismatch", message, n, "body.model") for n in lines]
    if chosen is None and not errors:  # a file stored before lines were kept
        errors.append(InputError("model_not_found", "No request names a model of this server."))
    errors.sort(key=lambda e: e.line or 0)
    if errors or chosen is None:
        return errors[:MAX_REPORTED_ERRORS], None
    return [], chosen


def served_for_batches(
    spec: ServeSpec, name: str, allows: Callable[[str], bool]
) -> ServedModelSpec | str:
    """The served model batches naming `name` run on (an adapter's: its served model, whose
    job runs the adapter for that line), or why there is none."""
    found = spec.route(name)
    if found is None or not (allows(name) or allows(found[0].name)):
        return f"The model '{name}' does not exist or this key may not use it."
    served = found[0]
    if served.batch is None:
        return (
            f"The model '{name}' does not take batches on this server (its serve file "
            "entry has no batch section)."
        )
    return served
