"""The Ray session of a batch run: the cluster at RAY_ADDRESS, or a private local one."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# Object store cap for a local Ray: rows are small, and the rest of the memory is the engine's.
LOCAL_OBJECT_STORE_BYTES = 1 * 1024**3


def ray_init_kwargs(env: Mapping[str, str], cpu_count: int | None = None) -> dict[str, Any]:
    """Arguments for ray.init: the cluster at RAY_ADDRESS, or a private local one."""
    address = env.get("RAY_ADDRESS", "").strip()
    if address:
        return {"address": address}
    return {
        "address": "local",
        "num_cpus": cpu_count or os.cpu_count() or 1,
        "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
        "include_dashboard": False,
    }


@contextmanager
def ray_session() -> Iterator[None]:
    """Use the Ray already initialized in this process, or init one and shut it down after."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(**ray_init_kwargs(os.environ), log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
