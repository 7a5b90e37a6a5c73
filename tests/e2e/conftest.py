"""Fixtures every e2e module may use, registered once here so a session-scoped one really is
one per session: a fixture function assigned into several modules is a fixture of each, and
each would start its own (a second `tokenmill serve` kept alive to the session's end)."""

from tests.e2e.serve_fixtures import serve_adapters, serve_model_dir, serve_workdir, server

__all__ = ["serve_adapters", "serve_model_dir", "serve_workdir", "server"]
