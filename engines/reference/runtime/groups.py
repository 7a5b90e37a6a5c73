"""Sample groups (n > 1) in the step loop: which sample computes the prompt, which wait.

Plain Python (no torch); the engine does the fork itself (sampling the waiters' first tokens
and sharing the KV). A group's samples arrive as separate requests marked with the same
`SampleOf` (engines/samples.py). The first to be admitted leads: it is scheduled as usual.
Those admitted while it has not sampled its first token, with the same prompt and the same
sampling but for the seed, wait instead of being scheduled. When the leader samples its first
token the engine forks them onto its prompt KV; if the leader leaves before that (aborted,
failed), they are scheduled on their own. Samples admitted after the leader's first token, or
that differ from it, are scheduled on their own from the start (prefix caching then spares
them the prompt's full blocks).

`live` objects are the engine's per-request state; this module reads only `.request` (a
GenerationRequest) and keys everything by request id.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engines.api import GenerationRequest


class SampleGroups:
    def __init__(self) -> None:
        self._leaders: dict[str, Any] = {}  # group id -> leader, until its first token
        self._waiters: dict[str, list[Any]] = {}  # leader's request id -> samples waiting
        self._waiting_on: dict[str, str] = {}  # waiting sample's request id -> leader's

    @property
    def num_waiting(self) -> int:
        """Samples waiting on a leader (neither running nor queued in the scheduler)."""
        return len(self._waiting_on)

    def admit(self, live: Any) -> bool:
        """Register an admitted request; True when it is to wait for its group's leader (not
        to be scheduled now)."""
        group = live.request.sample_of
        if group is None or group.count < 2:
            return False
        leader = self._leaders.get(group.group_id)
        if leader is None:
            self._leaders[group.group_id] = live  # the first sample computes the prompt
            return False
        if not same_draw(leader.request, live.request):
            return False
        leader_id = leader.request.request_id
        self._waiters.setdefault(leader_id, []).append(live)
        self._waiting_on[live.request.request_id] = leader_id
        return True

    def has_waiters(self, live: Any) -> bool:
        return live.request.request_id in self._waiters

    def first_token(self, live: Any) -> list[Any]:
        """`live` sampled its first token: a group it leads takes no more waiters, and the
        samples waiting on it are handed back to fork it."""
        self._drop_leader(live)
        return self._take_waiters(live)

    def leave(self, live: Any) -> list[Any]:
        """`live` left the engine. A sample that waited stops waiting; a leader that had no
        first token yet hands back its waiters, to be scheduled on their own."""
        leader_id = self._waiting_on.pop(live.request.request_id, None)
        if leader_id is not None:
            waiters = self._waiters.get(leader_id, [])
            waiters.remove(live)
            if not waiters:
                self._waiters.pop(leader_id, None)
        self._drop_leader(live)
        return self._take_waiters(live)

    def _drop_leader(self, live: Any) -> None:
        group = live.request.sample_of
        if group is not None and self._leaders.get(group.group_id) is live:
            del self._leaders[group.group_id]

    def _take_waiters(self, live: Any) -> list[Any]:
        waiters = self._waiters.pop(live.request.request_id, [])
        for waiter in waiters:
            del self._waiting_on[waiter.request.request_id]
        return waiters


def same_draw(a: GenerationRequest, b: GenerationRequest) -> bool:
    """Whether two samples of a group draw from the same distribution (same prompt, same
    sampling but for the seed), so one prompt computation serves both."""
    return a.prompt_token_ids == b.prompt_token_ids and dataclasses.replace(
        a.sampling, seed=None
    ) == dataclasses.replace(b.sampling, seed=None)
