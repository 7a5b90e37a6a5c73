"""The engine replicas behind the ingress: one Engine per Serve replica, and what surrounds it.

replica (the engine deployment: open_engine, cancellation, per-request device time, health
checks), local (the same replica in the ingress's own process, for `http.one_hop`), health (stall
and dead-engine detection), coalesce (stream deltas merged in time), cost (equal-share device
time for engines without step records), routing (prefix-aware routing across a model's
replicas), board (the actor replicas post their stats and health verdicts to) and testhooks
(fault injection, off unless TOKENMILL_TEST_HOOKS=1).
"""
