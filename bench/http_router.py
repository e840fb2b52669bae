"""Our router (`router.api.app.create_app`) in front of OpenAI-compatible HTTP workers, for
side-by-side benchmarks with other routers.

    python bench/http_router.py --port 9300 --workers http://127.0.0.1:9001 http://127.0.0.1:9002
"""

from __future__ import annotations

import argparse

import uvicorn

from router.api.app import create_app
from router.backends.http import HttpBackend
from router.config import RouterConfig
from router.tokenizer import Tokenizer
from worker.loader.builtin import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument("--workers", nargs="+", required=True)
    parser.add_argument("--model", default="fake", help="model id the workers serve")
    parser.add_argument("--tokenizer", default="tiny", help="built-in model name or HF dir")
    parser.add_argument("--policy", default="cost")
    args = parser.parse_args()
    config = RouterConfig(
        model=args.model, tokenizer=str(resolve_model(args.tokenizer)), policy=args.policy
    )
    tokenizer = Tokenizer(config.tokenizer)
    backends = [
        HttpBackend(f"w{i}", url, model=args.model, encode=tokenizer.encode_plain)
        for i, url in enumerate(args.workers)
    ]
    app = create_app(config, backends, tokenizer=tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
