"""An engine in a process of its own, driven over a socket, with the Engine contract unchanged.

Why: an engine that runs on a thread (the reference engine's step loop) shares its process's
GIL with whoever calls it. In a Serve replica that is the HTTP ingress: parsing, tokenizing,
JSON and SSE framing for every stream. The step loop's Python between kernels (scheduling,
sampling, detokenizing) and the ingress's request handling then take turns on one GIL, and the
process as a whole runs on about one core whatever the machine has (measured on the `small`
model under load: the replica process spent 31 ms of CPU per request at 30 requests/s, 0.94
of a core, with the other core two thirds idle; docs/benchmarks.md). In a child process the
engine has a GIL of its own, as vLLM's engine core does, and the two sides run in parallel.

The child may run under another interpreter (`interpreter`: the engine's own environment, such
as TensorRT-LLM's container Python, while the parent runs Ray Serve in one whose fastapi the
engine's pins exclude). It then imports tokenmill from that environment, so both sides first
check they speak the same protocol and version (`handshake`).

What crosses the socket (pickled tuples, a socket pair read and written as a
`multiprocessing.connection.Connection`):
    child → parent: ("hello", Side), first, before anything else;
    parent → child: (kind, model, settings) once; then ("submit", tag, request, stream)
                    | ("abort", request_id) | ("break", mode) | ("shutdown",)
    child → parent: ("loaded", info, stats) or ("failed", error), once; then
                    ("batch", records, stats, items) with items [(tag, item, final)] (stats:
                    the EngineDeadError reading them raised, once the engine died), and
                    ("closed",) last.
A batch holds everything that reached the child's loop in one turn of it: with the reference
engine's per-step delivery, one message per step for all requests. Its step records travel
ahead of its items, so a caller that sees a request finish can already drain every step the
request took part in (cost relies on this, as on the engine itself). Requests are matched by a
parent-side tag, not by request_id, so a duplicate id gets the engine's own error result. Both
sides read time.monotonic(), one clock for every process on a machine, so timings and step
records compare with the parent's own.

The child dies with the parent (it sees the socket close); a child that dies fails every
request in flight with EngineDeadError, and the parent's later calls raise it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import platform
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata
from multiprocessing.connection import Connection
from typing import Any

from engines.api import (
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    StepRecord,
    StreamDelta,
)
from engines.factory import load_engine
from engines.faults import break_step_loop
from engines.sinks import Sink, await_result, deliver, stream_items

# The child posts its stats this often while they change, even with nothing to deliver: a
# step loop that hangs with requests admitted must show as running, not idle, or the replica's
# stall watch (pipeline/serve/replicas/health.py) would never see it stop stepping.
STATS_INTERVAL_S = 0.05
# A child that does not exit this long after being asked to is killed.
SHUTDOWN_TIMEOUT_S = 30.0
# What crosses the socket, versioned: raise it with any change to the messages above or to
# the engines.api types they carry. Both sides also check tokenmill's own version, since the
# pickled types are tokenmill's.
# 2: GenerationRequest.adapter (LoRA); 3: GenerationRequest.images; 4: ImageInput.source.
PROTOCOL = 4
# A child that has not said hello this long after starting never will (an interpreter that
# cannot import tokenmill exits at once; one that hangs while importing is as useless).
HELLO_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Side:
    """One end of the socket: what the other checks before any engine is loaded."""

    protocol: int
    tokenmill: str  # the installed distribution's version ("unknown" outside an install)
    interpreter: str  # sys.executable
    python: str  # platform.python_version()

    @classmethod
    def here(cls) -> Side:
        try:
            version = metadata.version("tokenmill")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return cls(PROTOCOL, version, sys.executable, platform.python_version())

    def describe(self) -> str:
        return f"tokenmill {self.tokenmill} under {self.interpreter} (Python {self.python})"


def handshake(ours: Side, theirs: Side) -> str | None:
    """Why the engine process `theirs` cannot serve this side `ours`, or None."""
    if theirs.protocol == ours.protocol and theirs.tokenmill == ours.tokenmill:
        return None
    return (
        f"the engine process runs {theirs.describe()} (engine protocol {theirs.protocol}), "
        f"this side {ours.describe()} (engine protocol {ours.protocol}); install the same "
        "tokenmill version in both environments"
    )


class ProcessEngine:
    """`load_engine(kind, model, **settings)` run in a child process.

    Loading blocks until the child has loaded the engine, and raises what loading raised there
    (as an EngineError naming it when the exception itself cannot cross the pipe).
    """

    def __init__(
        self, kind: str, model: str, *, interpreter: str | None = None, **settings: Any
    ) -> None:
        """`interpreter`: the Python to run the engine under (a path; null: this one). Another
        interpreter imports tokenmill and the engine from its own environment."""
        # A fresh interpreter (not fork: this process holds threads; not multiprocessing's
        # spawn, which re-imports the caller's __main__).
        python = interpreter or sys.executable
        self._kind = kind
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [python, *child_flags(python), "-m", "engines.process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=child_env(python),
            )
        except OSError as exc:
            ours.close()
            theirs.close()
            raise EngineError(
                f"cannot start the {kind} engine process under {python}: {exc}; "
                "set replicas.engine_python to an interpreter that exists on the node"
            ) from None
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self.peer = self._hello(python)
            message = self._load(kind, model, settings)
        except BaseException:
            # However loading ended here (the child died, settings that cannot cross, Ctrl-C),
            # no child is left loading a model nobody will use.
            self._stop_child()
            raise
        if message[0] == "failed":
            self._stop_child(SHUTDOWN_TIMEOUT_S)
            error = message[1]
            if python != sys.executable:  # say where: the other environment may lack the engine
                raise EngineError(
                    f"{error} (in the engine process: {self.peer.describe()}; this side: "
                    f"{Side.here().describe()})"
                )
            raise error
        _, self.info, self._stats = message
        self.info: EngineInfo
        self._stats: EngineStats
        self._lock = threading.Lock()  # sinks, records, stats, dead
        self._send_lock = threading.Lock()
        self._sinks: dict[int, Sink] = {}
        self._records: list[StepRecord] = []
        self._next_tag = 0
        self._dead: str | None = None
        self._shut_down = False  # shutdown() was called: an exit then is not a death
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="engine-pipe-reader", daemon=True)
        self._reader.start()

    def _hello(self, python: str) -> Side:
        """The child's Side, checked against ours before anything else crosses."""
        ours = Side.here()
        if not self._conn.poll(HELLO_TIMEOUT_S):
            raise EngineError(
                f"the {self._kind} engine process under {python} did not start within "
                f"{HELLO_TIMEOUT_S:.0f} s"
            )
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait(5)
            raise EngineError(
                f"the {self._kind} engine process under {python} exited before it started "
                f"(exit code {code}): {_import_problem(python)}; this side runs "
                f"{ours.describe()}: install the same tokenmill version there"
            ) from None
        except Exception as exc:  # a reply this side cannot unpickle: another tokenmill
            raise EngineError(
                f"the {self._kind} engine process under {python} answered what this side "
                f"({ours.describe()}) cannot read ({type(exc).__name__}: {exc}); install the "
                "same tokenmill version in both environments"
            ) from None
        theirs = message[1] if message[0] == "hello" else None
        if not isinstance(theirs, Side):
            raise EngineError(
                f"the {self._kind} engine process under {python} did not say hello "
                f"({message[0]!r}); install the same tokenmill version as this side's "
                f"({ours.describe()})"
            )
        problem = handshake(ours, theirs)
        if problem is not None:
            raise EngineError(problem)
        return theirs

    def _load(self, kind: str, model: str, settings: dict[str, Any]) -> tuple:
        self._conn.send((kind, model, settings))
        try:
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            code = self._process.wait(5)
            raise EngineError(
                f"the {kind} engine process exited while loading (exit code {code}); its "
                "log says why"
            ) from None

    def _stop_child(self, grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for the child to exit, then kill it; close the socket."""
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._conn.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    # ---- the Engine contract -------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await await_result(
            lambda sink: self._submit(request, sink, stream=False),
            lambda: self.abort(request.request_id),
        )

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        return stream_items(
            lambda sink: self._submit(request, sink, stream=True),
            lambda: self.abort(request.request_id),
        )

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):
            self._send(("abort", request_id))

    def drain_step_records(self) -> list[StepRecord]:
        with self._lock:
            records, self._records = self._records, []
        return records

    def stats(self) -> EngineStats:
        """The child's last posted stats, checked against the child itself: raises
        EngineDeadError once it has exited (its last stats would say "idle" forever, and a
        health check reading them would call a dead engine healthy), and counts requests
        sent but not yet reported by it as waiting (a child that hangs before it posts them
        shows busy with its step count frozen, which the stall watch calls a stall)."""
        code = self._process.poll()
        with self._lock:
            if self._dead is None and code is not None:
                self._dead = f"its process exited with code {code}"
            if self._dead is not None and not self._shut_down:
                raise EngineDeadError(f"the engine process has stopped ({self._dead})")
            stats, sent = self._stats, len(self._sinks)
        unreported = sent - stats.num_running - stats.num_waiting
        if unreported > 0:
            stats = dataclasses.replace(stats, num_waiting=stats.num_waiting + unreported)
        return stats

    def shutdown(self) -> None:
        """Ask the child to stop (requests in flight finish "cancelled", as on the engine
        itself), wait for it, kill it if it does not go. Idempotent."""
        self._shut_down = True  # stats stay readable, as on an engine shut down in-process
        with contextlib.suppress(EngineDeadError):
            self._send(("shutdown",))
        self._closed.wait(SHUTDOWN_TIMEOUT_S)
        try:
            self._process.wait(SHUTDOWN_TIMEOUT_S if self._closed.is_set() else 0.1)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._fail_all("shut down")
        self._conn.close()

    def break_step_loop(self, mode: str) -> None:
        """Test hook (TOKENMILL_TEST_HOOKS=1 in the child): break the child engine's step
        loop, as engines.faults.break_step_loop does in one process."""
        self._send(("break", mode))

    # ---- plumbing ------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest, sink: Sink, stream: bool) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine process has stopped ({self._dead})")
            tag = self._next_tag
            self._next_tag += 1
            self._sinks[tag] = sink
        try:
            self._send(("submit", tag, request, stream))
        except BaseException:
            with self._lock:
                self._sinks.pop(tag, None)
            raise

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # the pipe is closed: the child is gone
                raise EngineDeadError(f"the engine process has stopped ({exc})") from None

    def _read(self) -> None:
        """Reader thread: route each batch to the callers' loops, one wake-up per loop."""
        reason = "its process exited"
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "closed":
                    reason = "shut down"
                    break
                _, records, stats, items = message
                routed: list[tuple[Sink, Any]] = []
                with self._lock:
                    self._records.extend(records)
                    if isinstance(stats, EngineDeadError):  # the engine died in the child
                        self._dead = self._dead or str(stats)
                    else:
                        self._stats = stats
                    for tag, item, final in items:
                        sink = self._sinks.pop(tag, None) if final else self._sinks.get(tag)
                        if sink is not None:
                            routed.append((sink, item))
                deliver(routed)
        except (EOFError, OSError):
            try:  # the socket closes a moment before the process can be reaped
                code: int | None = self._process.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            reason = "its process exited" + (f" with code {code}" if code is not None else "")
        finally:
            self._fail_all(reason)
            self._closed.set()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            sinks, self._sinks = self._sinks, {}
        error = EngineDeadError(f"the engine process has stopped ({reason})")
        deliver((sink, error) for sink in sinks.values())


def child_env(python: str) -> dict[str, str]:
    """The child's environment. Under this interpreter it gets this process's import path (a
    child of a test or a Ray worker imports what its parent does); under another, that
    interpreter's own environment decides, and only PYTHONPATH set for this process (by the
    user, for both sides) carries over: this side's site-packages would mix two installs."""
    if python == sys.executable:
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return dict(os.environ)


def child_flags(python: str) -> list[str]:
    """Under another interpreter, -P: `-m` would put the working directory first on its
    path, and a tokenmill source tree there (a Ray worker's working_dir, a checkout) would
    shadow the one installed in that environment, version check included."""
    return [] if python == sys.executable else ["-P"]


def _import_problem(python: str) -> str:
    """Why `python` cannot import tokenmill's engine process: its own last error line."""
    try:
        probe = subprocess.run(
            [python, *child_flags(python), "-c", "import engines.process"],
            env=child_env(python),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"it exited with code {probe.returncode}"


# ---- the child ---------------------------------------------------------------------------


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an EngineError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc}")
    return exc


def _child_main(fd: int) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        conn.send(("hello", Side.here()))
        kind, model, settings = conn.recv()
    except (EOFError, OSError):
        return

    try:
        engine = load_engine(kind, model, **settings)
    except BaseException as exc:
        conn.send(("failed", _portable(exc)))
        conn.close()
        return
    conn.send(("loaded", engine.info, engine.stats()))
    asyncio.run(_Child(conn, engine).run())


class _Child:
    """The child's side: commands read on its event loop, one batch out per loop turn."""

    def __init__(self, conn: Any, engine: Any) -> None:
        self._conn = conn
        self._engine = engine
        self._items: list[tuple[int, Any, bool]] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped: asyncio.Future[None] | None = None
        self._last_stats: EngineStats | EngineDeadError | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        # The socket is read on this loop itself (no reader thread): a request reaches the
        # engine without a thread hand-off (measured: about 0.4 ms less per lone request).
        loop.add_reader(self._conn.fileno(), self._readable)
        ticker = loop.create_task(self._post_stats())
        await self._stopped
        ticker.cancel()
        # shutdown joins the step loop, which first hands every request in flight its
        # "cancelled" result; those reach the request tasks here before the last batch.
        await asyncio.to_thread(self._engine.shutdown)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=SHUTDOWN_TIMEOUT_S)
        self._flush()
        self._conn.send(("closed",))
        self._conn.close()

    def _readable(self) -> None:
        """Every message waiting on the socket, handled in order."""
        try:
            while self._conn.poll():
                message = self._conn.recv()
                self._handle(message)
                if message[0] == "shutdown":
                    asyncio.get_running_loop().remove_reader(self._conn.fileno())
                    return
        except (EOFError, OSError):
            # The parent is gone: nobody reads what the engine would make.
            os._exit(0)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            _, tag, request, stream = message
            task = asyncio.get_running_loop().create_task(self._run(tag, request, stream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif kind == "abort":
            self._engine.abort(message[1])
        elif kind == "break":
            # The parent checked that the hooks are on; an engine without a runner stays whole.
            with contextlib.suppress(Exception):
                break_step_loop(self._engine, message[1])
        elif kind == "shutdown" and self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    async def _run(self, tag: int, request: GenerationRequest, stream: bool) -> None:
        try:
            if stream:
                async for delta in self._engine.stream(request):
                    self._emit(tag, delta, delta.finished)
                    if delta.finished:
                        return
                raise EngineError("the engine's stream ended without its finished delta")
            self._emit(tag, await self._engine.generate(request), True)
        except BaseException as exc:
            self._emit(tag, _portable(exc), True)
            if not isinstance(exc, Exception):
                raise

    def _emit(self, tag: int, item: Any, final: bool) -> None:
        self._items.append((tag, item, final))
        if not self._flush_scheduled:
            # After every task this loop turn woke: one message for all of them.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        items, self._items = self._items, []
        # Records first (drained after the items were made, so they hold every step the
        # items came from), then the items.
        records = self._engine.drain_step_records()
        stats = self._stats()
        self._last_stats = stats
        self._conn.send(("batch", records, stats, items))

    def _stats(self) -> EngineStats | EngineDeadError:
        """The engine's stats, or the EngineDeadError reading them raised: the parent's
        stats() then raises it (with the engine's own reason), and the items still go."""
        try:
            return self._engine.stats()
        except EngineDeadError as exc:
            return exc

    async def _post_stats(self) -> None:
        while not isinstance(self._last_stats, EngineDeadError):
            await asyncio.sleep(STATS_INTERVAL_S)
            stats = self._stats()
            if stats != self._last_stats:
                self._last_stats = stats
                self._conn.send(("batch", self._engine.drain_step_records(), stats, []))


if __name__ == "__main__":
    # Run from the module itself, not this __main__ copy of it: what the child pickles (Side)
    # must name engines.process, which the parent can import.
    from engines.process import _child_main as child_main

    child_main(int(sys.argv[1]))
