"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from starlette.responses import Response

from .response_models import ErrorResponse, encode

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client (HTTP status + OpenAI error body)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body as ErrorResponse writes it."""
        return encode(ErrorResponse, self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}

    def response(self) -> Response:
        return Response(self.json(), status_code=self.status, headers=self.headers(), media_type="application/json")

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.code!r}, {self.message!r})"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class GenerationError(APIError):
    """A generation that ended abnormally after it was submitted (lost engine, gap, timeout...)."""
