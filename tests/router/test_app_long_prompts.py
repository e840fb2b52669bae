"""Request bodies are parsed and tokenized on the router's tokenize threads, not on the event
loop (on the loop when `tokenize_threads` is 0), with the same token ids, and their errors
still come back in the OpenAI format."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

LONG = " ".join(f"word{i % 997} and {i % 13}" for i in range(6000))  # ~90 KB


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


@pytest.fixture(scope="module", params=[2, 0], ids=["threads", "on-the-loop"])
def live(tokenizer, request):
    workers = [FakeWorker("w0", max_context=1 << 16), FakeWorker("w1", max_context=1 << 16)]
    config = RouterConfig(model="tiny", tokenize_threads=request.param)
    app = create_app(config, workers, tokenizer=tokenizer)
    threads: list[str] = []
    build = app.state.jobs.completion_job

    def recording(body, session_id):
        threads.append(threading.current_thread().name)
        return build(body, session_id)

    app.state.jobs.completion_job = recording
    with LiveServer(app) as server:
        server.threads = threads
        server.off_loop = request.param > 0
        yield server


def test_long_texts_tokenize_to_the_same_ids(tokenizer) -> None:
    assert tokenizer.encode(LONG) == tokenizer.hf.encode(LONG, add_special_tokens=True)
    assert tokenizer.encode_plain(LONG) == tokenizer.hf.encode(LONG, add_special_tokens=False)


def test_every_prompt_is_tokenized_on_the_tokenize_threads(live, tokenizer) -> None:
    def complete(prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3}
        resp = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    short = complete("a short prompt")
    long = complete(LONG)
    assert long["usage"]["prompt_tokens"] == len(tokenizer.encode(LONG))
    assert short["usage"]["prompt_tokens"] == len(tokenizer.encode("a short prompt"))
    short_thread, long_thread = live.threads[-2:]
    if live.off_loop:
        assert short_thread.startswith("radixray-tokenize")
        assert long_thread.startswith("radixray-tokenize")
    else:
        assert short_thread == long_thread == live.thread.name  # the thread running the loop


def test_a_bad_long_request_gets_an_openai_error(live) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": LONG}],
        "top_logprobs": 2,  # without logprobs: rejected while the job is built
    }
    resp = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "top_logprobs" and error["type"] == "invalid_request_error"
