"""deploy/k8s locked down, pod by pod, in every overlay as kustomize renders it: the
"restricted" Pod Security Standard with a read-only root filesystem, writable mounts where
vLLM writes, NetworkPolicies that admit only clients, Prometheus and (multinode) the pods of
the same Ray group, Ray's token authentication, and the optional API key from a Secret.
Each check also runs against a manifest broken on purpose, so it can fail."""

from __future__ import annotations

import copy
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from deploy_manifests import (
    IMAGES,
    OVERLAYS,
    admits,
    container_env,
    dockerfile_env,
    find,
    pod_specs,
    pod_templates,
    render,
    restricted_violations,
    vllm_serve_argv,
)

OVERLAY_NAMES = sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir())
API_PORT = 8000
RAY_PORT = 6379


@cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(OVERLAYS / overlay)


def _ns(name: str, **labels: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **labels}


# Who knocks: (namespace labels, pod labels). The server runs in namespace "default".
CLIENT = (_ns("default"), {"vllm-dflash.io/client": "true"})
CLIENTS_NAMESPACE = (_ns("apps", **{"vllm-dflash.io/clients": "true"}), {"app": "gateway"})
PROMETHEUS = (_ns("monitoring"), {"app.kubernetes.io/name": "prometheus"})
NEIGHBOUR = (_ns("default"), {"app": "something-else"})
STRANGER = (_ns("elsewhere"), {"app": "x"})


# ---- Pod Security Standard -------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_every_pod_meets_the_restricted_standard(overlay):
    bad = {
        label: v
        for label, spec in pod_specs(rendered(overlay))
        if (v := restricted_violations(spec))
    }
    assert not bad


def _breaks(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    def pod(key, value):
        def f(s):
            s["securityContext"][key] = value

        return f

    def container(key, value):
        def f(s):
            s["containers"][0]["securityContext"][key] = value

        return f

    def no_seccomp(s):
        del s["securityContext"]["seccompProfile"]

    def host_path(s):
        s["volumes"].append({"name": "host", "hostPath": {"path": "/"}})

    def token(s):
        s["automountServiceAccountToken"] = True

    return [
        ("seccompProfile", no_seccomp),
        ("runAsNonRoot", pod("runAsNonRoot", False)),
        ("allowPrivilegeEscalation", container("allowPrivilegeEscalation", True)),
        ("drop ALL", container("capabilities", {"drop": []})),
        ("adds capabilities", container("capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]})),
        ("root filesystem", container("readOnlyRootFilesystem", False)),
        ("hostPath", host_path),
        ("automountServiceAccountToken", token),
    ]


def test_the_standard_check_catches_each_violation():
    (_, spec), *_ = pod_specs(rendered("single-gpu"))
    assert restricted_violations(spec) == []
    for expected, brk in _breaks(spec):
        broken = copy.deepcopy(spec)
        brk(broken)
        found = restricted_violations(broken)
        assert any(expected in v for v in found), (expected, found)


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_what_vllm_writes_lands_on_a_writable_mount(overlay):
    """The root filesystem is read-only: /tmp, $HOME (Triton, inductor, FlashInfer caches),
    the hub cache and vLLM's cache root must each lie on a writable volume."""
    objs = rendered(overlay)
    for label, spec in pod_specs(objs):
        for c in spec["containers"]:
            image = IMAGES[c["image"].rsplit("/", 1)[-1].split(":", 1)[0]]
            env = dockerfile_env(image) | container_env(c, objs)
            mounts = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
            for what in ("/tmp", env.get("HOME"), env.get("HF_HOME"), env.get("VLLM_CACHE_ROOT")):
                assert what and any(what == m or what.startswith(m + "/") for m in mounts), (
                    f"{overlay} {label}: {what} is not on a writable mount ({mounts})"
                )


# ---- NetworkPolicies --------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_only_clients_and_prometheus_reach_the_api(overlay):
    objs = rendered(overlay)
    policies = find(objs, "NetworkPolicy")
    for label, labels, spec in pod_templates(objs):
        pod = (labels, spec)
        ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for peer in (CLIENT, CLIENTS_NAMESPACE, PROMETHEUS):
            # a Ray worker serves no API: nobody is admitted to a port it does not open
            assert admits(policies, pod, peer, API_PORT) == (API_PORT in ports), (label, peer)
        for peer in (NEIGHBOUR, STRANGER):
            assert not admits(policies, pod, peer, API_PORT), (overlay, label, peer)
            assert not admits(policies, pod, peer, RAY_PORT), (overlay, label, peer)


def test_only_the_group_reaches_ray():
    objs = rendered("multinode")
    policies = find(objs, "NetworkPolicy")
    templates = pod_templates(objs)
    assert {label for label, _, _ in templates} == {
        "LeaderWorkerSet/leaderTemplate",
        "LeaderWorkerSet/workerTemplate",
    }
    for _, labels, spec in templates:
        for _, peer_labels, _ in templates:  # leader <-> worker, both ways
            assert admits(policies, (labels, spec), (_ns("default"), peer_labels), RAY_PORT)
        for peer in (CLIENT, CLIENTS_NAMESPACE, PROMETHEUS, NEIGHBOUR, STRANGER):
            assert not admits(policies, (labels, spec), peer, RAY_PORT), peer
        # another group of the same app (another LeaderWorkerSet) is not this group
        other = labels | {"leaderworkerset.sigs.k8s.io/name": "other"}
        assert not admits(policies, (labels, spec), (_ns("default"), other), RAY_PORT)


def test_the_policy_check_catches_an_open_rule():
    objs = rendered("single-gpu")
    policies = copy.deepcopy(find(objs, "NetworkPolicy"))
    (_, labels, spec), *_ = pod_templates(objs)
    assert not admits(policies, (labels, spec), STRANGER, API_PORT)
    del policies[0]["spec"]["ingress"][0]["from"]  # a rule without peers admits everyone
    assert admits(policies, (labels, spec), STRANGER, API_PORT)
    assert admits([], (labels, spec), STRANGER, API_PORT)  # no policy: everything


# ---- Ray token authentication -------------------------------------------------------------------
def _ray_containers() -> list[tuple[str, dict[str, Any], str]]:
    out = []
    for label, spec in pod_specs(rendered("multinode")):
        for c in spec["containers"]:
            script = " ".join(c.get("command", []) + c.get("args", []))
            if "ray start" in script:
                out.append((label, c, script))
    return out


def test_every_ray_process_requires_the_token():
    found = _ray_containers()
    assert len(found) == 2  # the head (leader) and the worker
    for label, c, script in found:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", label
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "vllm-dflash-ray-token" and not ref.get("optional"), label
        # the version check runs, and must pass, before Ray starts
        assert script.index('python3 -c "$RAY_AUTH_CHECK"') < script.index("ray start"), label
        if "--head" in script:
            assert "--include-dashboard=false" in script


@pytest.mark.parametrize(("version", "ok"), [("2.51.9", False), ("2.52.0", True), ("3.0.1", True)])
def test_the_ray_check_refuses_a_ray_without_token_auth(tmp_path, version, ok):
    (_, c, _), *_ = _ray_containers()
    check = next(e["value"] for e in c["env"] if e["name"] == "RAY_AUTH_CHECK")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True
    )
    assert (out.returncode == 0) == ok, out.stderr
    if not ok:
        assert "needs 2.52 or later" in out.stderr


# ---- API key ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_the_api_key_comes_from_an_optional_secret_to_the_server_only(overlay):
    objs = rendered(overlay)
    for label, spec in pod_specs(objs):
        for c in spec["containers"]:
            refs = [e["secretRef"] for e in c.get("envFrom", []) if "secretRef" in e]
            if vllm_serve_argv(c, objs) is None:  # a Ray worker serves nothing
                assert not refs, label
                continue
            assert refs == [{"name": "vllm-dflash-api-key", "optional": True}], label


def test_vllm_reads_the_api_key_from_its_environment():
    """What the Secret sets, VLLM_API_KEY, is what vLLM's server reads as --api-key."""
    import vllm
    import vllm.envs as envs

    assert "VLLM_API_KEY" in envs.environment_variables
    src = Path(vllm.__file__).parent / "entrypoints"
    assert any("envs.VLLM_API_KEY" in p.read_text() for p in src.rglob("*.py"))
