"""What an external engine's Prometheus `/metrics` says about its shape and load.

vLLM reports its KV cache configuration as labels of `vllm:cache_config_info` (`block_size`,
`num_gpu_blocks`, `num_cpu_blocks`), its load as `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (0..1), and, like every
prometheus_client process, `process_start_time_seconds` (a new value: the engine restarted).
SGLang names its load `sglang:num_running_reqs` and `sglang:num_queue_reqs`. vLLM also times its
own prefills: per request, the prefill phase's seconds (`vllm:request_prefill_time_seconds`,
from the first scheduled step to the first token, so without queueing) and the KV tokens it
computed (`vllm:request_prefill_kv_computed_tokens`, cached ones excluded), both histograms
observed as each request finishes; their sums and count are `prefills`. Figures an engine does
not report stay None: the router then keeps its own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class EngineMetrics:
    """The figures read from one scrape; None where the engine did not report one."""

    block_size: int | None = None
    kv_blocks: int | None = None  # device KV capacity in blocks
    host_kv_blocks: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # fraction of device KV in use
    start_time: float | None = None
    prefill_requests: int | None = None  # requests whose prefill the engine timed, ever
    prefill_tokens: int | None = None  # KV tokens those computed (cached ones excluded)
    prefill_s: float | None = None  # seconds their prefill phases took

    @property
    def prefills(self) -> tuple[int, int, float] | None:
        """(requests, computed tokens, seconds) of every prefill the engine timed since it
        started; None unless it reports all three."""
        if self.prefill_requests is None or self.prefill_tokens is None or self.prefill_s is None:
            return None
        return self.prefill_requests, self.prefill_tokens, self.prefill_s

    @property
    def kv_tokens(self) -> int | None:
        if self.block_size is None or self.kv_blocks is None:
            return None
        return self.block_size * self.kv_blocks


# series summed over the engine's data-parallel ranks: name -> (field, type)
_SUMMED = {
    "vllm:num_requests_running": ("running", int),
    "sglang:num_running_reqs": ("running", int),
    "vllm:num_requests_waiting": ("waiting", int),
    "sglang:num_queue_reqs": ("waiting", int),
    "vllm:request_prefill_time_seconds_count": ("prefill_requests", int),
    "vllm:request_prefill_time_seconds_sum": ("prefill_s", float),
    "vllm:request_prefill_kv_computed_tokens_sum": ("prefill_tokens", int),
}


def _int_label(labels: dict[str, str], name: str) -> int | None:
    value = labels.get(name, "")
    return int(value) if value.isdigit() else None


# every series read below: the scrape parses only their lines
_READ = ("vllm:cache_config_info", *_SUMMED, "vllm:kv_cache_usage_perc",
         "process_start_time_seconds")


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The figures of a Prometheus text exposition (unknown series are ignored; a malformed
    line of a series read here raises ValueError).

    Only the lines of the series read here reach the parser (their comments dropped: the
    samples parse the same untyped). vLLM's exposition is hundreds of lines of histograms;
    parsed whole, each scrape would take the router's event loop many times longer than the
    lines read here do.
    """
    out = EngineMetrics()
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_READ))
    for family in text_string_to_metric_families(lines + "\n"):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "vllm:cache_config_info":
                out.block_size = _int_label(labels, "block_size") or out.block_size
                out.kv_blocks = _int_label(labels, "num_gpu_blocks") or out.kv_blocks
                out.host_kv_blocks = _int_label(labels, "num_cpu_blocks") or out.host_kv_blocks
            elif name in _SUMMED:
                field, kind = _SUMMED[name]
                setattr(out, field, (getattr(out, field) or 0) + kind(value))
            elif name == "vllm:kv_cache_usage_perc":
                out.kv_usage = max(out.kv_usage or 0.0, float(value))
            elif name == "process_start_time_seconds":
                out.start_time = float(value)
    return out
