"""Fixtures every e2e module may use, registered once here so a shared one really is one: a
fixture function assigned into several modules is a fixture of each, and each would start its
own (a second `tokenmill serve`, a second Ray head).

Package scope: the shared server and head stop when the last e2e test is done, rather than
idling beside the rest of the suite."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from engines import faults
from tests.e2e.ray_head import RayHead, running_ray_head
from tests.e2e.serve_fixtures import (
    reasoning_models,
    serve_adapters,
    serve_model_dir,
    serve_workdir,
    server,
    vision_model_dir,
)

__all__ = [
    "ray_head",
    "reasoning_models",
    "serve_adapters",
    "serve_model_dir",
    "serve_workdir",
    "server",
    "vision_model_dir",
]

# The shared head's engines sleep this long after every step: the Batch API's cancel tests
# (tests/e2e/test_batch_api.py) then see 200-1500 requests take 25 s or more on any machine,
# so a cancel after the first part lands mid-run; short jobs (test_submit) barely notice.
HEAD_STEP_DELAY_S = 0.01


@pytest.fixture(scope="package")
def ray_head() -> Iterator[RayHead]:
    """One `ray start --head` (Jobs API, token auth) for the modules that submit jobs."""
    with contextlib.ExitStack() as stack:
        head = stack.enter_context(running_ray_head(faults.step_delay_env(HEAD_STEP_DELAY_S)))
        _closers["ray_head"] = stack.pop_all().close
        try:
            yield head
        finally:
            _close("ray_head")


# --- shared processes live from their first user to their last -----------------------------
#
# A package-scoped fixture would stay up until the last e2e test, idling (a Ray head, a
# server with three engines) beside everything else; these are closed right after the last
# test that uses them, and the modules that use each are run next to one another.

SHARED = ("ray_head", "server")
_closers: dict[str, Callable[[], object]] = {}
_last_user: dict[str, str] = {}  # shared fixture -> nodeid of the last test using it


def _close(name: str) -> None:
    closer = _closers.pop(name, None)
    if closer is not None:
        closer()


def _shared_users(item: pytest.Item) -> set[str]:
    """The shared fixtures (this conftest's, not a module's own of the same name) `item` uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    used = set()
    for name in SHARED:
        defs = info.name2fixturedefs.get(name) or ()
        if defs and defs[-1].baseid == CONFTEST_BASEID:
            used.add(name)
    return used


CONFTEST_BASEID = "tests/e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Modules that use a shared process run together (head users, then server users, then
    # the rest, each in its usual order), so each shared process lives a short stretch.
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(module: list[pytest.Item]) -> int:
        used = set().union(*(_shared_users(i) for i in module))
        if not module[0].nodeid.startswith(CONFTEST_BASEID + "/"):
            return -1  # another package's tests keep their place (before or after e2e)
        return 0 if "ray_head" in used else 1 if "server" in used else 2

    e2e = [m for m in modules.values() if rank(m) >= 0]
    if not e2e:
        return
    first = items.index(e2e[0][0])
    ordered = [i for m in sorted(e2e, key=rank) for i in m]
    # A test that stops the shared server goes after the server's last other user.
    enders = [i for i in ordered if i.get_closest_marker("ends_shared_server")]
    ordered = [i for i in ordered if i not in enders]
    users = [k for k, i in enumerate(ordered) if "server" in _shared_users(i)]
    at = users[-1] + 1 if users else len(ordered)
    ordered[at:at] = enders
    rest = [i for i in items if not i.nodeid.startswith(CONFTEST_BASEID + "/")]
    items[:] = rest[:first] + ordered + rest[first:]
    for item in items:
        for name in _shared_users(item):
            _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, last in _last_user.items():
        if item.nodeid == last:
            _close(name)
