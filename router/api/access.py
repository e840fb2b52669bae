"""Who may call what: the inference key, the admin key, loopback clients (`check`).

Every request falls in one class (`route_class`):

- inference: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/v1/sessions/*` (and any
  other `/v1/*` path): `Authorization: Bearer <api_key>` when `api_key` is set, else open.
- admin, the verbs that change state for every client: `POST /v1/workers`,
  `POST /v1/workers/{id}/drain`, `DELETE /v1/workers/{id}` and everything under
  `/v1/admin/`: `Bearer <admin_key>` when `admin_key` is set; without one, loopback clients
  only. The inference key never opens them (403 when it is presented).
- observe: `GET /metrics`, `GET /v1/workers` (worker ids, KV, load): the admin key or a
  loopback client; every client with `metrics_public`.
- open: `/health` and every path outside `/v1/` (unknown ones get 404).

A loopback client is one whose address (the ASGI `client`, which uvicorn takes from
`X-Forwarded-For` only when the peer itself is on loopback) is in 127.0.0.0/8 or ::1. A
reverse proxy on the router's host must therefore set `X-Forwarded-For`, or the router must
have an admin key.
"""

from __future__ import annotations

import hmac
import ipaddress

from router.config import RouterConfig
from router.errors import APIError, admin_forbidden, invalid_admin_key, invalid_api_key

INFERENCE, ADMIN, OBSERVE, OPEN = "inference", "admin", "observe", "open"


def route_class(method: str, path: str) -> str:
    """The class of a request (see the module docstring)."""
    if path == "/metrics" or (path == "/v1/workers" and method == "GET"):
        return OBSERVE
    if path.startswith("/v1/admin/") or path == "/v1/admin":
        return ADMIN
    if path == "/v1/workers" or path.startswith("/v1/workers/"):
        return ADMIN
    if path.startswith("/v1/"):
        return INFERENCE
    return OPEN


def is_loopback(client: tuple[str, int] | list | None) -> bool:
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _bearer(headers: dict[bytes, bytes]) -> bytes:
    value = headers.get(b"authorization", b"")
    return value[7:].strip() if value[:7].lower() == b"bearer " else b""


def _same(given: bytes, key: str | None) -> bool:
    return bool(key) and bool(given) and hmac.compare_digest(given, key.encode())


def check(config: RouterConfig, scope: dict, headers: dict[bytes, bytes]) -> APIError | None:
    """None when the request may go on, else the 401 / 403 it gets."""
    kind = route_class(scope["method"], scope["path"])
    if kind == OPEN:
        return None
    given = _bearer(headers)
    if kind == INFERENCE:
        if config.api_key and not _same(given, config.api_key):
            return invalid_api_key()
        return None
    if kind == OBSERVE and config.metrics_public:
        return None
    if config.admin_key:
        if _same(given, config.admin_key):
            return None
        if kind == OBSERVE and is_loopback(scope.get("client")):
            return None
        if _same(given, config.api_key):
            return admin_forbidden("The inference API key does not open admin endpoints; "
                                   "use the admin key.")
        return invalid_admin_key()
    if is_loopback(scope.get("client")):
        return None
    return admin_forbidden("Admin endpoints answer loopback clients only on a router started "
                           "without an admin key (--admin-key or RADIXRAY_ADMIN_KEY).")
