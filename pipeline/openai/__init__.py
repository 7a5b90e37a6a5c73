"""The OpenAI wire format shared by Serve and batch: one table of request parameters
(params.py) and reasoning output (reasoning.py); see docs/architecture.md."""
