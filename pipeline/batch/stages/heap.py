"""Garbage collector settings for the actors that move rows (prompt and engine actors).

Such an actor handles thousands of rows a second, each a handful of container objects (the
row's dict and token list, a task, futures, a result, an outcome), most of them alive for a
few milliseconds, while a shard's rows and finished outcomes stay alive for the whole shard.
With CPython's default thresholds (700, 10, 10) the collector ran a young pass every few rows
and, every few thousand, a full pass over everything alive: Ray's, pyarrow's and the model
code's objects, and the shard's rows. In-process, on an engine actor's path at 1-token
answers (synthetic engine), collection was about half of the CPU per row; see the capacity
section of docs/benchmarks.md.
"""

from __future__ import annotations

import atexit
import gc

# A young pass per this many new container objects (a few thousand rows' worth) instead of
# 700; each pass stays short (milliseconds), and cyclic garbage waits at most that long.
YOUNG_THRESHOLD = 50_000


def settle_after_load() -> None:
    """Call once an actor has loaded what it keeps for its life (modules, engine, tokenizer).

    Freezing moves all of that out of the collector's sight (reference counting still frees
    it), so a full pass walks only the objects of the rows in hand; the higher young
    threshold makes passes rare. Process-wide, so only in a Ray actor's own process: a driver
    or a test that builds an actor's class in-process keeps its collector as it was.
    """
    if not _in_actor():
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 10, 10)
    # At exit the frozen objects go back to the collector: left frozen, extension modules
    # (nanobind's, in torch's triton) report them as leaked on the way out.
    atexit.register(gc.unfreeze)


def _in_actor() -> bool:
    import ray

    # get_runtime_context() would start a Ray instance when used outside one.
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
