"""The OpenAI-compatible output shared by batch and Serve (see docs/architecture.md)."""
