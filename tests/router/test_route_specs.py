"""`radixray route`'s worker specs and what it reads from an engine's `/metrics` (no engine
needed; tests/vllm runs both against real vLLM servers)."""

from __future__ import annotations

import pytest

from cluster.route import ExternalWorkers, WorkerSpec, parse_worker
from router.backends.external.metrics import parse_engine_metrics
from router.errors import APIError


def test_worker_spec_parses_url_and_event_endpoints():
    spec = parse_worker("http://10.0.0.5:8000/v1/,events=tcp://10.0.0.5:5557,"
                        "replay=tcp://10.0.0.5:5558")
    assert spec == WorkerSpec("http://10.0.0.5:8000", "tcp://10.0.0.5:5557",
                              "tcp://10.0.0.5:5558")
    assert spec.worker_id == "10.0.0.5:8000"
    assert parse_worker("http://h:1,events=ipc:///tmp/e.sock").events == "ipc:///tmp/e.sock"
    assert parse_worker("https://h:1") == WorkerSpec("https://h:1")


@pytest.mark.parametrize("text", [
    "h:8000",  # no scheme
    "ftp://h:1",
    "http://h:1,events=http://h:2",
    "http://h:1,replay=tcp://h:3",  # replay without events
    "http://h:1,events=tcp://h:2,events=tcp://h:3",
    "http://h:1,topic=x",
    "http://h:1,events",
    "http://h:1,events=ipc://",
])
def test_bad_worker_specs_are_refused(text):
    with pytest.raises(ValueError):
        parse_worker(text)


def test_live_add_validates_the_body():
    workers = ExternalWorkers(block_size=128)
    backend = workers.url_worker({"url": "http://h:1", "events": "tcp://h:2"})
    assert backend.worker_id == "h:1" and backend.block_size == 128
    for body, status in [({"url": 5}, 400),
                         ({"url": "http://h:2", "port": 3}, 400),
                         ({"url": "http://h:2", "replay": "tcp://h:3"}, 400)]:
        with pytest.raises(APIError) as info:
            workers.url_worker(body)
        assert info.value.status == status
    with pytest.raises(APIError) as info:
        workers.add_worker()
    assert info.value.status == 400


VLLM_METRICS = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7954686229e+09
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.6
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 1.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.25
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 3.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 391.0
vllm:request_prefill_kv_computed_tokens_count{engine="1",model_name="m"} 1.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="m"} 150.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_cpu_blocks="None",num_gpu_blocks="12"} 1.0
"""


def test_engine_metrics_read_vllms_shape_and_load():
    m = parse_engine_metrics(VLLM_METRICS)
    assert (m.block_size, m.kv_blocks, m.kv_tokens, m.host_kv_blocks) == (128, 12, 1536, None)
    assert (m.running, m.waiting, m.kv_usage) == (4, 2, 0.25)
    assert m.start_time == pytest.approx(1.7954686229e9)
    assert m.prefills == (4, 541, pytest.approx(0.85))  # the prefills it timed, both ranks


def test_engine_metrics_read_only_their_series():
    """The series read are picked out before parsing: a histogram, a longer name that starts
    like a read one, and a broken line of a series not read change none of the figures."""
    histogram = "".join(
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}"}} 1.0\n'
        for le in ("0.01", "0.1", "1.0", "+Inf"))
    text = (VLLM_METRICS + "# TYPE vllm:time_to_first_token_seconds histogram\n" + histogram
            + 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
            + "vllm:spec_decode_broken{engine= 3\n")
    assert parse_engine_metrics(text) == parse_engine_metrics(VLLM_METRICS)


def test_engine_metrics_of_a_server_that_reports_none():
    m = parse_engine_metrics("# TYPE radixray_requests counter\nradixray_requests_total 3.0\n")
    assert m.block_size is None and m.kv_tokens is None and m.running is None
    assert m.prefills is None
    with pytest.raises(ValueError):
        parse_engine_metrics("vllm:num_requests_running{engine= 3\n")
