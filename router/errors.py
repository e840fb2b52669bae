"""OpenAI-format errors: one exception type the handlers raise, one body shape clients get."""

from __future__ import annotations

import json


class APIError(Exception):
    """An error answered to the client as `{"error": {"message","type","param","code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def invalid_api_key() -> APIError:
    return APIError(401, "Invalid or missing API key.", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def no_workers() -> APIError:
    return APIError(503, "No worker is available to serve the request.", code="no_workers")


def not_implemented(what: str) -> APIError:
    return APIError(501, f"{what} is not available on this router.", code="not_implemented")


def invalid_admin_key() -> APIError:
    return APIError(401, "Invalid or missing admin key.", code="invalid_admin_key")


def admin_forbidden(reason: str) -> APIError:
    return APIError(403, reason, code="admin_forbidden", type_="permission_error")


def request_timeout(seconds: float) -> APIError:
    return APIError(
        408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout"
    )


def headers_too_large(limit: int) -> APIError:
    return APIError(
        431, f"Request headers exceed {limit} bytes.", code="request_header_fields_too_large"
    )
