"""Prefix-aware routing across the engine replicas of one model.

Each replica's engine keeps a prefix cache of KV blocks, so a request whose prompt starts like
an earlier one (a shared system prompt, a few-shot preamble, a multi-turn chat) skips that
part of its prefill, but only on the replica that computed it. Serve's default router picks
replicas by queue length alone and scatters such requests; this one sends them back.

How a replica is chosen, for a request whose prompt token ids are known:
- the prompt is cut into blocks of `block_tokens` and each block gets a hash chained over all
  tokens before it (as the reference engine's prefix cache does), so equal hashes mean equal
  prefixes;
- the longest prefix this router has sent to a replica that is still running picks that
  replica; a prompt with no known prefix picks by rendezvous hashing of its first block, so
  the first request of a new prefix and everything that shares that first block agree;
- affinity yields to load: when the preferred replica holds `imbalance` more requests than
  the least loaded one (by the queue lengths Serve's router caches), every candidate is
  ranked by load instead, as the default router would;
- every routed request records its block hashes for the replica that took it (least
  recently used first out, at most `max_entries`).

The state is per router, that is per ingress replica: with several ingress replicas each
learns the prefixes it saw, and rendezvous hashing makes them agree on new ones anyway.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

_MAX_PENDING = 10_000  # requests being routed at once, far above any real backlog


def prefix_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """One chained hash per full block of `token_ids` (the last, partial block has none)."""
    hashes: list[int] = []
    parent = 0
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        parent = hash((parent, tuple(token_ids[end - block_tokens : end])))
        hashes.append(parent)
    return hashes


def rendezvous(key: int, replica_ids: Sequence[str]) -> int:
    """Index of the replica with the highest hash of (key, replica): stable as replicas come
    and go (only the keys of a removed replica move)."""

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest()

    return max(range(len(replica_ids)), key=lambda i: score(replica_ids[i]))


def prompt_ids(request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt token ids of a call to an engine replica (a GenerationRequest argument)."""
    if request is None or not request.args:
        return None
    ids = getattr(request.args[0], "prompt_token_ids", None)
    return ids if isinstance(ids, list) else None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, block_tokens: int = 16, imbalance: int = 8, max_entries: int = 200_000, **_: Any
    ) -> None:
        self._block_tokens = block_tokens
        self._imbalance = imbalance
        self._max_entries = max_entries
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix hash -> replica
        # request id -> its hashes, until routed (bounded: a cancelled request never is)
        self._hashes: OrderedDict[str, list[int]] = OrderedDict()

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_load = sorted(candidate_replicas, key=self._queue_len)
        ids = prompt_ids(pending_request)
        if len(candidate_replicas) < 2 or not ids:
            return [by_load]
        hashes = prefix_hashes(ids, self._block_tokens) or [hash((0, tuple(ids)))]
        self._hashes[pending_request.metadata.internal_request_id] = hashes
        while len(self._hashes) > _MAX_PENDING:
            self._hashes.popitem(last=False)
        by_id = {r.replica_id: r for r in candidate_replicas}
        preferred = None
        for h in reversed(hashes):  # the longest known prefix wins
            owner = self._owner.get(h)
            if owner in by_id:
                preferred = by_id[owner]
                break
        if preferred is None:
            names = [r.replica_id.unique_id for r in candidate_replicas]
            preferred = candidate_replicas[rendezvous(hashes[0], names)]
        if self._queue_len(preferred) - self._queue_len(by_load[0]) >= self._imbalance:
            return [by_load]  # affinity is not worth a queue this much longer
        return [[preferred], [r for r in by_load if r is not preferred]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        if not hashes:
            return
        for h in hashes:
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)
