"""Stand-in for `tensorrt_llm.executor.utils` (1.2), where the real RequestError is defined.

In the real library a per-request failure reported by the executor (an error response for one
request) is raised as RequestError from awaiting or iterating that request's result; the LLM
stays usable. Any other exception from the background executor shuts the LLM down.
"""


class RequestError(RuntimeError):
    """One request failed inside the executor; other requests are unaffected."""
