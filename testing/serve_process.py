"""`radixray serve` as a real process tree, for the fault tests and the chaos soak.

`ServeProcess` starts the command in its own session (a shell's foreground job), collects its
output, and finds its Ray processes by the actor class in their titles (`ray::...FleetActor`,
`WorkerActor`, `RouterActor`; a named actor's title holds its name too): the ones a fault
schedule kills and whose memory it reads.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil

# the actor class in a Ray process's title (`ray::[name:]Class[.method]`)
TITLES = {"fleet": "FleetActor", "worker": "WorkerActor", "router": "RouterActor"}


def serve_command() -> list[str]:
    exe = shutil.which("radixray")
    return [exe] if exe else [sys.executable, "-m", "cluster.cli"]


class ServeProcess:
    """`radixray serve ARGS` in a subprocess; `stop()` sends SIGTERM and waits for its exit."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        env.pop("RADIXRAY_API_KEY", None)
        self.proc = subprocess.Popen(
            [*serve_command(), "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until serve prints its ready banner; AssertionError (with its output) when it exits
        or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not any("Press Ctrl-C" in line for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.1)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def pids(self, kind: str) -> list[int]:
        """Live pids of one kind of actor (`TITLES`), oldest first."""
        title = TITLES[kind]
        found = []
        for p in self.descendants():
            try:
                command = " ".join(p.cmdline())
                if command.startswith("ray::") and title in command and p.status() != "zombie":
                    found.append((p.create_time(), p.pid))
            except psutil.Error:
                continue
        return [pid for _, pid in sorted(found)]

    def rss_mb(self, kind: str) -> list[float]:
        """Resident memory (MB) of each live actor of one kind."""
        out = []
        for pid in self.pids(kind):
            try:
                out.append(psutil.Process(pid).memory_info().rss / 2**20)
            except psutil.Error:
                continue
        return out

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (what docker stop and Kubernetes send), then wait; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(30)
