"""The load generator against a live fake worker over real HTTP on 127.0.0.1."""

import argparse
import asyncio
import json
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest

from cluster.loadgen.cli import add_bench_args, run_bench
from testing.fake_protocol import word_tokenizer
from testing.fake_worker import FakeWorkerConfig, serve


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_url():
    """One fake worker (time model at 1/20 speed... i.e. 20x faster) in a background loop."""
    port = _free_port()
    loop = asyncio.new_event_loop()
    config = FakeWorkerConfig("fake-0", "fake", kv_tokens=200_000, time_scale=0.05)
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        runners = loop.run_until_complete(serve([config], "127.0.0.1", [port], word_tokenizer))
        started.set()
        loop.run_forever()
        for r in runners:
            loop.run_until_complete(r.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.headers, resp.read().decode()


def test_repeated_prompt_reports_real_cached_tokens(fake_url):
    prompt = " ".join(f"w{i}" for i in range(300))
    body = {"model": "fake", "prompt": prompt, "max_tokens": 4}
    headers, first = _post(fake_url + "/v1/completions", body)
    assert headers["X-Radixray-Worker"] == "fake-0"
    usage = json.loads(first)["usage"]
    assert usage["prompt_tokens"] == 300 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    _, text = _post(fake_url + "/v1/completions", stream)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 299


def test_bad_requests_get_openai_errors(fake_url):
    for body in ({"model": "fake", "prompt": "a", "max_tokens": -1}, {"model": "fake"}, [1, 2]):
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(fake_url + "/v1/completions", body)
        assert err.value.code == 400
        assert "message" in json.loads(err.value.read())["error"]


def test_sglang_router_registration_endpoints(fake_url):
    for path in ("/health", "/get_server_info", "/get_model_info", "/v1/models"):
        with urllib.request.urlopen(fake_url + path, timeout=10) as resp:
            assert resp.status == 200
            json.loads(resp.read())


def _bench(argv, capsys):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    code = run_bench(parser.parse_args(argv))
    return code, json.loads(capsys.readouterr().out)


def test_bench_concurrency_measures_latency_hits_and_workers(fake_url, capsys):
    argv = ["--url", fake_url, "--workload", "shared-prefix", "--groups", "2",
            "--prompts-per-group", "6", "--words-per-block", "8", "--max-tokens", "8",
            "--concurrency", "3", "--json", "--no-progress"]
    code, s = _bench(argv, capsys)
    assert code == 0
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["requests_per_worker"] == {"fake-0": 12}
    assert 0.5 < s["hit_rate"] < 1.0  # the system prompts repeat, the questions do not
    assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
    assert s["itl"]["p50"] > 0 and s["throughput_rps"] > 0


def test_bench_rate_is_bounded_by_count(fake_url, capsys):
    argv = ["--url", fake_url, "--workload", "chat", "--sessions", "5", "--turns", "3",
            "--words-per-block", "4", "--max-tokens", "4", "--rate", "50",
            "--num-requests", "7", "--json", "--no-progress", "--no-stream"]
    code, s = _bench(argv, capsys)
    assert code == 0 and s["completed"] == 7
    assert s["ttft"]["p50"] == pytest.approx(s["e2e"]["p50"], rel=0.5)


def test_fit_writes_a_profile_from_a_live_worker(fake_url, tmp_path):
    from cluster.sim.fit import main as fit_main
    from cluster.sim.time_model import TimeProfile

    out = tmp_path / "fitted.json"
    argv = ["--url", fake_url, "--out", str(out), "--lengths", "16,128", "--batches", "1,3",
            "--repeats", "1", "--prefill-budget", "64"]
    assert fit_main(argv) == 0
    profile = TimeProfile.load(out)
    assert profile.prefill_budget == 64 and profile.name.startswith("fitted:")
    coefs = (profile.base_s, profile.token_s, profile.attn_pair_s, profile.kv_read_s)
    assert all(c >= 0 for c in coefs) and any(c > 0 for c in coefs)


def test_an_http2_probe_is_refused_in_one_line_and_http1_still_works(fake_url, caplog):
    """sglang-router opens a gRPC (HTTP/2, prior knowledge) call to each worker: the fake
    worker refuses it without a traceback per attempt, and keeps serving HTTP/1.1."""
    host, port = fake_url.removeprefix("http://").split(":")
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(preface)
                assert b" 400 " in conn.recv(64)
        headers, body = _post(f"{fake_url}/v1/completions",
                              {"model": "fake", "prompt": "a b c", "max_tokens": 2})
    assert json.loads(body)["choices"]
    assert not [r for r in caplog.records if r.exc_info]
    refused = [r for r in caplog.records if "HTTP/2" in r.getMessage()]
    assert len(refused) <= 1  # once per process: an earlier test may have logged it already
