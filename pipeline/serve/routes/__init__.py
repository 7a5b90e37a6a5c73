"""The OpenAI routes of the ingress, one module per family, each a set of functions of the
ingress's Gateway (pipeline.serve.gateway): `generate` (/v1/chat/completions and
/v1/completions, whole answers), `streaming` (their server-sent events), `embeddings`,
`models`, and `ops` (/metrics and the test hook). /v1/files and /v1/batches are
pipeline.serve.batch_api's."""
