"""uvicorn as the router runs it (`server_config`): what its HTTP parser refuses answers in the
OpenAI error format, and request headers are bounded while they are read.

uvicorn answers a request its parser cannot read (`Content-Length: abc`, a broken request line)
with a plain-text 400 before the app sees it; `RouterHttpProtocol` answers the same with the
OpenAI error body. It also counts the bytes of the request line and headers as the parser
delivers them and answers 431 past `max_header_bytes`, so a client cannot make the router
buffer megabytes of headers (the app checks the same bound for servers it does not run, such
as Ray Serve's proxy).
"""

from __future__ import annotations

import json
from typing import Any

import uvicorn

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn's h11 parser, bounded by its own limit
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class HeadersTooLarge(Exception):
    """Raised from a parser callback: the request's head passed its bound."""


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error body that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-radixray-worker: none\r\nconnection: close\r\n\r\n")
    return head % (status, _REASONS[status], len(body)) + body


if HttpToolsProtocol is not None:

    class RouterHttpProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with bounded headers and OpenAI-format errors."""

        max_header_bytes = 64 * 1024

        _head_open = False  # between a request's first byte and the end of its headers
        _unparsed = 0  # bytes fed to the parser while the head was open
        _too_large = False

        def data_received(self, data: bytes) -> None:
            if self._too_large:
                return
            super().data_received(data)
            if self._head_open and not self._too_large:
                # one header still arriving (httptools holds it whole before `on_header`)
                self._unparsed += len(data)
                if self._unparsed > self.max_header_bytes:
                    self._too_large = True
                    self.send_400_response("headers too large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open, self._unparsed, self._head_bytes = True, 0, 0

        def on_headers_complete(self) -> None:
            self._head_open = False
            super().on_headers_complete()

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > self.max_header_bytes:
                self._too_large = True
                raise HeadersTooLarge

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                limit = self.max_header_bytes
                data = error_response(431, f"Request headers exceed {limit} bytes.",
                                      "request_header_fields_too_large")
            else:
                data = error_response(400, f"Invalid HTTP request: {msg}", "invalid_http")
            self.transport.write(data)
            self.transport.close()


def server_config(app: Any, max_header_bytes: int, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for the router app: `kwargs` are uvicorn's own (host, port, ...)."""
    if HttpToolsProtocol is None:
        return uvicorn.Config(app, http="h11", h11_max_incomplete_event_size=max_header_bytes,
                              **kwargs)
    protocol = type("BoundedRouterHttpProtocol", (RouterHttpProtocol,),
                    {"max_header_bytes": max_header_bytes})
    return uvicorn.Config(app, http=protocol, **kwargs)
