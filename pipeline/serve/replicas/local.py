"""An engine replica in the ingress's own process, called the way a Serve handle is called.

With `http.one_hop` a single-model application runs the engine inside the ingress replica:
a request then crosses the HTTP proxy and one replica, not the proxy, the ingress and an
engine replica, and no request or stream item is pickled between processes. The ingress code
stays the same; these wrappers give it what it uses of a DeploymentHandle:
`.generate.remote(...)` (awaitable, `.cancel()`), `.options(stream=True).stream.remote(...)`
(async iterator, `.cancel()`), `.info.remote()` and `.debug_break_engine.remote(...)`.
Cancelling runs the replica method's own cleanup (abort in the engine), as Serve's
cancellation of a remote call does.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any


class LocalCall:
    """A running call: awaitable once, cancellable."""

    def __init__(self, result: Any) -> None:
        if inspect.isawaitable(result):
            self._future = asyncio.ensure_future(result)
        else:
            self._future = asyncio.get_running_loop().create_future()
            self._future.set_result(result)

    def __await__(self):
        return self._future.__await__()

    def cancel(self) -> None:
        self._future.cancel()


class LocalStream:
    """A running stream: async iterator; `cancel()` closes the generator (its `finally`
    aborts the request in the engine) once the consumer has stopped iterating."""

    def __init__(self, generator: AsyncIterator[Any]) -> None:
        self._generator = generator
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._generator.__anext__()

    def cancel(self) -> None:
        close = getattr(self._generator, "aclose", None)
        if close is not None and self._closing is None:
            # Called from the consumer's own cleanup, so the generator is not running now.
            self._closing = asyncio.ensure_future(close())


class _Method:
    def __init__(self, fn: Callable[..., Any], stream: bool) -> None:
        self._fn = fn
        self._stream = stream

    def remote(self, *args: Any, **kwargs: Any) -> LocalCall | LocalStream:
        if self._stream:
            return LocalStream(self._fn(*args, **kwargs))
        return LocalCall(self._fn(*args, **kwargs))


class LocalEngine:
    """A DeploymentHandle look-alike over an EngineReplica instance in this process."""

    def __init__(self, replica: Any, stream: bool = False) -> None:
        self._replica = replica
        self._stream = stream

    def options(self, *, stream: bool = False, **_: Any) -> LocalEngine:
        return LocalEngine(self._replica, stream)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self._replica, name), self._stream)
