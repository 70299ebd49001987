"""A real ``vllm serve`` process (the CLI) with our plugin answers the OpenAI API.

One server per module, started from the venv's CLI with DFlash speculation on the tiny
target, is asked for completions (alone and concurrently) and chat completions; every greedy
output must equal the HF reference's. The server is always stopped (SIGINT, then SIGKILL
after a timeout) and the teardown checks that it and every process it spawned have exited.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from vllm_dflash.bench.server import Server, serve
from vllm_dflash.reference.generate import target_generate

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("serving_api")]

K = 7
MODEL = "tiny-dflash"
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


@pytest.fixture(scope="module")
def server(target_dir, drafter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    spec = {"method": "dflash", "model": str(drafter_dirs[8]), "num_speculative_tokens": K}
    with serve(
        target_dir,
        tmp / "server.log",
        served_name=MODEL,
        speculative_config=spec,
        extra_args=["--chat-template", str(template)],
        env={"VLLM_DFLASH_BACKEND": "dflash"},
    ) as server:
        yield server


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
    before = server.metric_sum("vllm:spec_decode_num_drafts_total")
    _complete(server, tokenizer(PROMPTS[-1]).input_ids, 20)
    after = server.metric_sum("vllm:spec_decode_num_drafts_total")
    assert after > before, (before, after)
