"""The OpenAI layer shared by Serve and batch (it imports neither): request models and their
parsing (models.py), response bodies (responses.py), SSE framing (sse.py), error bodies
(errors.py), the one table of request parameters (params.py), embeddings bodies
(embeddings.py), chat rendering and tokenization (chat.py) and reasoning output
(reasoning.py); see docs/architecture.md."""
