"""The OpenAI wire format as both Serve and batch input read it (see params.py)."""
