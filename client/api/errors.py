"""`ApiError`: the OpenAI error object every refusal of the API becomes."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def model_not_found(model: str, served: list[str]) -> ApiError:
    """OpenAI's answer to a model it does not serve: 404, `model_not_found`."""
    return ApiError(404, f"the model '{model}' does not exist here; this server serves "
                    f"{', '.join(repr(m) for m in served)}", param="model", code="model_not_found")
