"""OpenAI's error body: {"error": {message, type, param, code}} with the HTTP status to send it
with. Raised by request parsing (400s) and by Serve's own checks (auth, limits, the Batch API);
Serve turns one into a response (or, mid-stream, into an SSE event)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def kind(self) -> str:
        """Short label for the errors-by-kind metric."""
        return self.code or self.type

    @classmethod
    def busy(cls, code: str, what: str, retry_after_s: int) -> ApiError:
        """429: the server has no room for this request now (`what`); try again later."""
        return cls(
            429,
            f"Server busy: {what}; retry after {retry_after_s} s",
            type="rate_limit_error",
            code=code,
            headers={"Retry-After": str(retry_after_s)},
        )
