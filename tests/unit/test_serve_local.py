"""The in-process engine handle of http.one_hop: calls, streams and cancellation behave like
a Serve handle's, and the spec decides when one hop applies."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.serve.replicas.local import LocalEngine
from pipeline.serve.spec import ServeSpec


class _Replica:
    def __init__(self) -> None:
        self.closed: list[str] = []
        self.cancelled: list[str] = []

    def info(self) -> str:
        return "info"

    async def generate(self, rid: str) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        return rid

    async def stream(self, rid: str):
        try:
            for i in range(100):
                yield f"{rid}-{i}"
                await asyncio.sleep(0)
        finally:
            self.closed.append(rid)


def test_calls_streams_and_cancellation() -> None:
    replica = _Replica()
    engine = LocalEngine(replica)

    async def main() -> None:
        assert await engine.info.remote() == "info"  # a plain method answers too
        call = engine.generate.remote("g")
        await asyncio.sleep(0)
        call.cancel()  # the client went away: the method's own cleanup runs
        with pytest.raises(asyncio.CancelledError):
            await call
        assert replica.cancelled == ["g"]
        stream = engine.options(stream=True).stream.remote("s")
        assert await stream.__anext__() == "s-0"
        assert [await stream.__anext__() for _ in range(3)] == ["s-1", "s-2", "s-3"]
        stream.cancel()
        await asyncio.sleep(0.01)
        assert replica.closed == ["s"]  # the generator's finally ran (engine abort)

    asyncio.run(main())


def _spec(models: int, one_hop) -> ServeSpec:
    return ServeSpec.model_validate(
        {
            "models": [{"name": f"m{i}", "model": {"path": "/x"}} for i in range(models)],
            "http": {"one_hop": one_hop},
        }
    )


def test_one_hop_is_on_for_one_model_unless_turned_off() -> None:
    assert _spec(1, None).one_hop is True
    assert _spec(1, False).one_hop is False
    assert _spec(2, None).one_hop is False
    with pytest.raises(ValueError, match=r"http\.one_hop needs exactly one model"):
        _spec(2, True)
