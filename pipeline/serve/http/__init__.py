"""The HTTP plumbing around the ingress, apart from its routes.

httpio (request bodies read within a limit, streamed responses that release what their request
held), haproxy (the environment of a Ray started for `http.direct_ingress`), probes (the /ready
and /health applications) and readiness (the ready probe's view, pure logic).
"""
