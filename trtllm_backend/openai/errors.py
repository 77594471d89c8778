"""Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) with their HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_param(param: str, message: str) -> OpenAIError:
    """400 naming the parameter; the message starts with it so a log line alone says what was wrong."""
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_parameter")


def unknown_model(name: str, served: str) -> OpenAIError:
    return OpenAIError(
        404, f"model {name!r} does not exist (this gateway serves {served!r})", param="model", code="model_not_found"
    )
