"""`radixray serve --engine vllm --routers 2`: the real command, its fleet of two vLLM workers
on a local Ray behind two router replicas, answering through the `openai` client; each replica
follows the engines' own KV events (a prompt one replica routed is a hit through the other);
then one worker's vLLM killed with SIGKILL (the stream on it fails over, the worker restarts
empty), the other drained live, a new vLLM worker added live (both replicas route to it and
follow its events), and the cluster stopped: no vLLM process is left at any step.

One cluster for the module (two vLLM start-ups cost a minute or more on a small machine). The
tests run in order. Each test talks to one replica at a time through the replica's own port
(the shared port spreads new connections over both), so that its metrics are one router's.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import psutil
import pytest
import requests

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from vllm_env import require_vllm  # noqa: E402
from vllm_server import BLOCK, free_port, vllm_model_dir  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

WORDS = list(range(70, 94))  # token ids of plain letters in the tiny tokenizer
MARK = "RADIXRAY_TEST_VLLM_SERVE"  # in the environment of every process the cluster starts
VLLM_ARGS = "--enforce-eager --max-model-len 1024 --num-gpu-blocks-override 24 --max-num-seqs 8"
# No probe of the engines' speeds (tests/vllm/test_vllm_route.py probes a real vLLM): on the
# tiny model the prefill of its longest probe prompt is ~8 ms, and the probes of two equal
# engines can read up to 4x apart; `cost` then sends new prompts to the one read faster
# while both are idle, where these tests need new prompts on each worker.
PROBE_TOKENS = 0


def prompt(seed: int, length: int) -> list[int]:
    return [WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(length)]


def marked(mark: str, worker_id: str | None = None) -> list[psutil.Process]:
    """The live processes whose environment carries `MARK=mark` and a worker id (`worker_id`,
    when given): the vLLM servers, their reapers and engine processes."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):  # gone, or a zombie, meanwhile
            continue
        owner = env.get("RADIXRAY_WORKER_ID")
        if env.get(MARK) == mark and owner is not None and worker_id in (None, owner):
            found.append(proc)
    return found


def vllm_server(mark: str, worker_id: str) -> psutil.Process | None:
    """The worker's vLLM OpenAI server process (not its reaper), if it runs."""
    for proc in marked(mark):
        try:
            cmd = proc.cmdline()
            if cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and (
                    proc.environ()["RADIXRAY_WORKER_ID"] == worker_id):
                return proc
        except (psutil.Error, OSError, IndexError):
            continue
    return None


def counter(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def replica_ports(shared_port: int) -> dict[int, int]:
    """Router replica pid -> the replica's own port, found from the replicas' listening sockets
    (each answers /health with its pid in `X-Radixray-Router`)."""
    pids: set[int] = set()
    for _ in range(100):  # new connections to the shared port reach every replica
        with requests.Session() as session:
            pids.add(int(session.get(f"http://127.0.0.1:{shared_port}/health",
                                     timeout=10).headers["x-radixray-router"]))
        if len(pids) == 2:
            break
    ports = {}
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            port = conn.laddr.port
            if conn.status != psutil.CONN_LISTEN or port == shared_port:
                continue
            try:
                answer = requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except requests.RequestException:
                continue  # one of Ray's own ports
            if answer.headers.get("x-radixray-router") == str(pid):
                ports[pid] = port
    return ports


def workers(url: str) -> dict[str, dict]:
    return {r["id"]: r for r in requests.get(url + "/v1/workers", timeout=10).json()["data"]}


def speeds(url: str) -> dict[str, tuple[float, float]]:
    """Each worker's (prefill tokens/s, decode step s) as the router at `url` prices it."""
    return {w: (r["prefill_tokens_per_s"], r["decode_step_s"]) for w, r in workers(url).items()}


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    python = require_vllm()
    root = tmp_path_factory.mktemp("vllm-serve")
    model = vllm_model_dir(root)
    port = free_port()
    # the cluster's temporary files (Ray's session, the vLLM servers' logs) in a short-named
    # folder of its own (Ray's socket paths must stay short), removed at the end; the vLLM
    # logs are kept beside the test's other files
    scratch = tempfile.mkdtemp(prefix="rr-vllm-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]), RADIXRAY_VLLM_PYTHON=python,
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", TMPDIR=scratch,
               **{MARK: str(root)})
    env.pop("RADIXRAY_API_KEY", None)
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--engine", "vllm", "--model",
           str(model), "--workers", "2", "--routers", "2", "--num-cpus", "2", "--port", str(port),
           f"--vllm-args={VLLM_ARGS}", "--probe-tokens", str(PROBE_TOKENS)]
    log = root / "serve.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    state = SimpleNamespace(url=url, model=str(model), mark=str(root), proc=proc, log=log)
    try:
        def up() -> bool:
            # the command's own word that it is ready: every replica has joined every worker
            # (a replica answers /health as soon as one worker has joined; another may still
            # be probing)
            text = log.read_text(errors="replace")
            assert proc.poll() is None, text[-5000:]
            return "radixray: ready in" in text and requests.get(
                url + "/health", timeout=2).status_code == 200
        wait_for(up, 900, "radixray serve --engine vllm to say it is ready")
        print(f"\nradixray serve --engine vllm: 2 vLLM workers serve after "
              f"{time.monotonic() - t0:.1f}s")
        ports = sorted(replica_ports(port).values())
        assert len(ports) == 2, ports
        state.url, state.other_url = (f"http://127.0.0.1:{p}" for p in ports)
        state.client = openai.OpenAI(base_url=state.url + "/v1", api_key="none", max_retries=0)
        state.other_client = openai.OpenAI(base_url=state.other_url + "/v1", api_key="none",
                                           max_retries=0)
        yield state
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        for left in marked(str(root)):  # never leave a vLLM behind, whatever failed
            left.kill()
        for vllm_log in Path(scratch).glob("radixray-vllm-*.log"):
            shutil.copy(vllm_log, root)
        shutil.rmtree(scratch, ignore_errors=True)


def test_serve_engine_vllm_answers_through_openai(cluster):
    rows = workers(cluster.url)
    assert sorted(rows) == ["worker-0", "worker-1"]
    assert {r["state"] for r in rows.values()} == {"ready"}
    assert {r["max_context"] for r in rows.values()} == {1024}  # vLLM's, read not assumed
    wait_for(lambda: {r["kv_total"] for r in workers(cluster.url).values()} == {24 * BLOCK},
             30, "the engines' KV capacity from their /metrics")
    # no replica probed an engine (`--probe-tokens 0` reached the workers, and the replicas
    # leave probing to them): before any request, no speed is measured
    for url in (cluster.url, cluster.other_url):
        assert set(speeds(url).values()) == {(0.0, 0.0)}, speeds(url)

    chat = cluster.client.chat.completions.create(
        model=cluster.model, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Hello there, who are you?"}])
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0

    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    messages = [{"role": "user", "content": text}]
    chunks = list(cluster.client.chat.completions.create(
        model=cluster.model, max_tokens=6, temperature=0, messages=messages, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first = chunks[-1].usage
    assert first.prompt_tokens > 2 * BLOCK
    time.sleep(1.0)  # its blocks' events reach the routers' index
    raw = cluster.client.chat.completions.with_raw_response.create(
        model=cluster.model, max_tokens=6, temperature=0, messages=messages)
    repeat = raw.parse()
    # vLLM's own figure, passed through: every whole block of the prompt was cached
    assert repeat.usage.prompt_tokens_details.cached_tokens == (
        (first.prompt_tokens - 1) // BLOCK * BLOCK)
    assert raw.headers["x-radixray-worker"] in rows


def completion(client: openai.OpenAI, model: str, ids: list[int]) -> tuple[str, int]:
    """(the worker that served it, vLLM's cached_tokens) of a 2-token completion."""
    raw = client.completions.with_raw_response.create(
        model=model, prompt=ids, max_tokens=2, temperature=0)
    return raw.headers["x-radixray-worker"], raw.parse().usage.prompt_tokens_details.cached_tokens


def burst(client: openai.OpenAI, model: str, seeds: list[int]) -> list[tuple[str, int]]:
    """`completion` of a 3-block prompt per seed, all sent at once. Sent one by one, new prompts
    can all go to one idle engine: the speeds the routers read from the engines' own timings are
    noise on the tiny model (milliseconds per prompt), two equal engines can look twofold apart,
    and `cost` takes the one that looks faster. At once, the load spreads them."""
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(lambda seed: completion(client, model, prompt(seed, 2 * BLOCK + 5)),
                             seeds))


def landing_on(url: str, client: openai.OpenAI, model: str, worker: str,
               first_seed: int) -> list[int]:
    """A new prompt the router at `url` (`client`) sent to `worker` (and that it now caches):
    bursts of 8 until one lands there."""
    for start in range(first_seed, first_seed + 40, 8):
        seeds = list(range(start, start + 8))
        for seed, (served, _) in zip(seeds, burst(client, model, seeds), strict=True):
            if served == worker:
                return prompt(seed, 2 * BLOCK + 5)
    pytest.fail(f"nothing was routed to {worker}; speeds {speeds(url)}")


def test_each_replica_follows_the_engines_own_events(cluster):
    # prompts routed through one replica only, sent together so that the load spreads them
    seeds = list(range(100, 108))
    probes = [prompt(seed, 2 * BLOCK + 5) for seed in seeds]
    first = burst(cluster.client, cluster.model, seeds)
    holders = [w for w, _ in first]
    assert len(set(holders)) == 2, holders  # else a replica that knew nothing could match
    time.sleep(1.0)  # their blocks' events reach both replicas' indexes
    # the other replica never routed them: it knows where they are from vLLM's events alone
    again = [completion(cluster.other_client, cluster.model, ids) for ids in probes]
    assert [w for w, _ in again] == holders
    assert [c for _, c in again] == [2 * BLOCK] * len(probes)  # vLLM's own figure


def test_killed_vllm_fails_over_then_its_worker_restarts_empty(cluster):
    url, client, mark = cluster.url, cluster.client, cluster.mark
    # prompts cached on both workers (sent together, the load spreads them)
    cached = [prompt(seed, 2 * BLOCK + 5) for seed in range(200, 206)]

    def send(ids: list[int]) -> str:
        raw = client.completions.with_raw_response.create(
            model=cluster.model, prompt=ids, max_tokens=2, temperature=0)
        return raw.headers["x-radixray-worker"]

    with concurrent.futures.ThreadPoolExecutor(len(cached)) as pool:
        where = list(pool.map(send, cached))
    time.sleep(1.0)

    stream = client.completions.create(
        model=cluster.model, prompt=prompt(7, BLOCK + 20), max_tokens=300, temperature=0,
        stream=True, extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    arrivals, usage, killed, server = [], None, None, None
    for chunk in stream:
        arrivals.append(time.monotonic())
        usage = chunk.usage or usage
        if killed is None and len(arrivals) == 3:
            killed = stream.response.headers["x-radixray-worker"]
            server = vllm_server(mark, killed)
            assert server is not None
            group = [p for p in marked(mark) if os.getpgid(p.pid) == os.getpgid(server.pid)]
            assert len(group) >= 3  # reaper, server, engine core (at least)
            t_kill = time.monotonic()
            server.send_signal(signal.SIGKILL)
    assert killed is not None
    assert usage.completion_tokens == 300  # the stream finished on the other worker
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > t_kill)
    print(f"\nfailover: longest wait between two chunks after the kill {gap:.2f}s, stream "
          f"done {arrivals[-1] - t_kill:.2f}s after the kill")

    # no orphan: the server's engine processes went with it
    wait_for(lambda: not any(p.is_running() for p in group), 30, "the old vLLM processes to go")

    # while it restarts, nothing is routed to it
    wait_for(lambda: workers(url)[killed]["state"] == "dead", 60, f"{killed} marked dead")
    other = next(w for w in workers(url) if w != killed)
    assert send(prompt(300, BLOCK + 3)) == other

    def back() -> bool:
        new = vllm_server(mark, killed)
        # (between the old backend's detach and the new one's join it is briefly not listed)
        return (new is not None and new.pid != server.pid
                and workers(url).get(killed, {}).get("state") == "ready")
    wait_for(back, 600, f"{killed} to restart and rejoin")
    print(f"restart: {killed} serves again {time.monotonic() - t_kill:.1f}s after the kill")

    # it rejoined empty: the routers expect none of what the old engine cached, and vLLM agrees
    on_killed = [ids for ids, w in zip(cached, where, strict=True) if w == killed]
    assert on_killed, f"no prompt was cached on {killed}: {where}"
    for ids in on_killed:
        predicted = counter(url, "radixray_cached_tokens_predicted_total")
        actual = counter(url, "radixray_cached_tokens_actual_total")
        raw = client.completions.with_raw_response.create(
            model=cluster.model, prompt=ids, max_tokens=2, temperature=0)
        if raw.headers["x-radixray-worker"] == killed:
            assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0
        assert counter(url, "radixray_cached_tokens_predicted_total") - predicted == (
            counter(url, "radixray_cached_tokens_actual_total") - actual)

    # and it serves again, its new events followed: a repeat sent to it is a hit
    probe = landing_on(url, client, cluster.model, killed, 400)
    time.sleep(1.0)
    raw = client.completions.with_raw_response.create(
        model=cluster.model, prompt=probe, max_tokens=2, temperature=0)
    assert raw.headers["x-radixray-worker"] == killed
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 2 * BLOCK

    # a live drain removes the other worker: its vLLM processes go, the restarted one serves on
    drained = requests.post(f"{url}/v1/workers/{other}/drain", timeout=120)
    assert drained.json() == {"id": other, "state": "removed"}, drained.text
    assert sorted(workers(url)) == [killed]
    wait_for(lambda: not marked(mark, other), 30, f"{other}'s vLLM processes to exit")
    assert send(prompt(500, BLOCK)) == killed


def test_a_vllm_worker_added_live_serves_and_every_replica_follows_it(cluster):
    url, model = cluster.url, cluster.model
    [left] = workers(url)
    t0 = time.monotonic()
    added = requests.post(f"{url}/v1/workers", json={"count": 1}, timeout=900)
    assert added.status_code == 200, added.text
    print(f"\nlive add: a new vLLM worker serves {time.monotonic() - t0:.1f}s after the call")
    [new] = set(workers(url)) - {left}
    assert vllm_server(cluster.mark, new) is not None
    # the other replica attaches it from the fleet's change
    wait_for(lambda: workers(cluster.other_url).get(new, {}).get("state") == "ready", 60,
             f"the other replica to attach {new}")
    assert workers(url)[new]["max_context"] == 1024  # read from the new vLLM

    probe = landing_on(url, cluster.client, model, new, 600)  # the new worker takes new prompts
    time.sleep(1.0)
    # its events reached the replica that did not route the prompt
    assert completion(cluster.other_client, model, probe) == (new, 2 * BLOCK)


def test_stopping_the_cluster_stops_every_vllm_process(cluster):
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(120) == 0, cluster.log.read_text()[-5000:]
    wait_for(lambda: not marked(cluster.mark), 30, "every vLLM process to exit")
