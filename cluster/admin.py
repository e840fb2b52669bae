"""`radixray workers list|add|drain|remove --url URL`: live scaling through the router's admin API.

The router app exposes the admin endpoints (behind the admin key when one is set, else to
loopback clients only: `router.api.access`); this module is only their command-line client,
using the standard library so it needs nothing installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from cluster.config import ADMIN_KEY_ENV

ACTIONS = ("list", "add", "drain", "remove")


def add_workers_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="list workers, add new ones, drain one (finish in-flight requests, "
                        "then remove it) or remove one at once")
    parser.add_argument("worker_id", nargs="?", help="the worker to drain or remove (worker-N)")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the router (default: %(default)s)")
    parser.add_argument("--count", type=int, default=1, help="workers to add (default: 1)")
    parser.add_argument("--admin-key", default=None,
                        help=f"the router's admin key (default: ${ADMIN_KEY_ENV}; none: the "
                        "router must be on this host)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds to wait for the router (adds wait for model loads)")


def admin_request(args: argparse.Namespace) -> tuple[str, str, dict | None]:
    """(method, path, json body) of the admin call an action makes."""
    if args.action == "list":
        return "GET", "/v1/workers", None
    if args.action == "add":
        return "POST", "/v1/workers", {"count": args.count}
    if not args.worker_id:
        raise SystemExit(f"radixray workers {args.action}: name the worker (e.g. worker-1)")
    if args.action == "drain":
        return "POST", f"/v1/workers/{args.worker_id}/drain", None
    return "DELETE", f"/v1/workers/{args.worker_id}", None


def run_workers(args: argparse.Namespace) -> int:
    method, path, body = admin_request(args)
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.url.rstrip("/") + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            print(json.dumps(json.loads(resp.read() or b"null"), indent=2))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"radixray workers {args.action}: HTTP {exc.code}: {exc.read().decode()}",
              file=sys.stderr)
    except urllib.error.URLError as exc:
        print(f"radixray workers {args.action}: cannot reach {args.url}: {exc.reason}",
              file=sys.stderr)
    return 1
