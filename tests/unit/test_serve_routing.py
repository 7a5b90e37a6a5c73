"""Prefix-aware routing: shared prefixes stick to one replica, new ones spread, load wins."""

from __future__ import annotations

import asyncio
from collections import namedtuple
from types import SimpleNamespace

from engines.api import GenerationRequest
from pipeline.serve.replicas.routing import PrefixAffinityRouter, prefix_hashes, rendezvous


def test_prefix_hashes_chain_over_full_blocks() -> None:
    a = prefix_hashes(list(range(40)), 16)
    b = prefix_hashes([*range(32), 99, 98, 97], 16)
    assert len(a) == 2 and a == b[:2]  # same first 32 tokens, partial tail ignored
    assert prefix_hashes([1, 2, 3], 16) == []
    assert prefix_hashes([*range(16), *range(16)], 16)[1] != prefix_hashes(list(range(16)), 16)[0]


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    replicas = ["r1", "r2", "r3"]
    before = {k: replicas[rendezvous(k, replicas)] for k in range(300)}
    after = {k: ["r1", "r3"][rendezvous(k, ["r1", "r3"])] for k in range(300)}
    assert len(set(before.values())) == 3
    assert all(after[k] == v for k, v in before.items() if v != "r2")


_ReplicaID = namedtuple("_ReplicaID", "unique_id")  # hashable, like Serve's ReplicaID


class _Cache:
    def __init__(self) -> None:
        self.lens: dict[str, int] = {}

    def get(self, replica_id):
        return self.lens.get(replica_id.unique_id)


def _router(imbalance: int = 4) -> tuple[PrefixAffinityRouter, _Cache, list]:
    router = object.__new__(PrefixAffinityRouter)  # Serve builds it with its own arguments
    cache = _Cache()
    router._replica_queue_len_cache = cache
    router.initialize_state(block_tokens=4, imbalance=imbalance)
    replicas = [SimpleNamespace(replica_id=_ReplicaID(f"r{i}")) for i in range(3)]
    return router, cache, replicas


def _route(router, replicas, ids: list[int], rid: str):
    pending = SimpleNamespace(
        args=[GenerationRequest(ids)], metadata=SimpleNamespace(internal_request_id=rid)
    )
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    chosen = ranks[0][0]
    router.on_request_routed(pending, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def test_shared_prefixes_stick_and_load_breaks_affinity() -> None:
    router, cache, replicas = _router()
    system_a, system_b = list(range(100, 112)), list(range(200, 212))
    a = {_route(router, replicas, [*system_a, 7, i, i + 1], f"a{i}") for i in range(10)}
    b = {_route(router, replicas, [*system_b, 7, i, i + 1], f"b{i}") for i in range(10)}
    assert len(a) == 1 and len(b) == 1  # every request of a prefix on one replica
    fresh = {_route(router, replicas, [300 + 4 * i, 1, 2, 3, 4], f"n{i}") for i in range(30)}
    assert len(fresh) == 3  # unrelated prefixes spread over all replicas
    (home,) = a
    cache.lens = {home: 9}  # the home replica is busy: 9 more than the others
    spill = _route(router, replicas, [*system_a, 1, 2, 3], "busy")
    assert spill != home
    # The spill replica now holds the prefix too and is its latest owner: the prefix stays
    # there while its load is fine.
    cache.lens = {home: 2}
    assert _route(router, replicas, [*system_a, 5, 6, 7], "calm") == spill
