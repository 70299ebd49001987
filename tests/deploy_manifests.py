"""Reading what deploy/ ships as Kubernetes and Docker would: kustomize renders, schema checks,
container commands resolved to the ``vllm serve`` argument list they run.

Used by tests/test_deploy_k8s.py and tests/test_deploy_docker.py.
"""

from __future__ import annotations

import gzip
import json
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = K8S / "overlays"
DOCKER = ROOT / "deploy" / "docker"
CRDS = Path(__file__).resolve().parent / "fixtures" / "crds"
# The Kubernetes release the core objects are validated against (kubernetes-validate's
# schemas). 1.30: LeaderWorkerSet and every field we use exist there, and it is old enough
# for most managed clusters.
K8S_VERSION = "1.30.0"
# Container images (the name kustomize's image setting leaves) -> the Dockerfile that builds
# them, whose ENTRYPOINT runs when a manifest gives only `args`.
IMAGES = {"vllm-dflash": DOCKER / "Dockerfile.gpu", "vllm-dflash-cpu": DOCKER / "Dockerfile.cpu"}
# Secrets a pod may not start without (deploy/README.md says how to create each).
REQUIRED_SECRETS = {"vllm-dflash-ray-token"}


def kustomize_command() -> list[str]:
    """`kubectl kustomize`, or a standalone `kustomize build` (`make tools` puts Debian's
    kubectl into .tools/bin where the machine has neither)."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    raise RuntimeError(
        "neither kubectl nor kustomize is on PATH. Fix: run the tests through `make test`, "
        "or `make tools` and put .tools/bin on PATH"
    )


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(f"kustomize {path} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


# --- schema validation ---------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields refused, as `kubectl apply` does (field
    validation "Strict" since 1.27) instead of the API server's silent pruning."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the published openAPIV3Schema, made strict."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml*")):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for crd in yaml.safe_load_all(raw):
            if not crd:
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def validate(obj: dict[str, Any]) -> None:
    """Raise if ``obj`` does not fit its kind's schema (a CRD fixture, else Kubernetes')."""
    import jsonschema
    import kubernetes_validate

    schema = crd_schemas().get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        # Not jsonschema.validate: that also checks the schema's own patterns as ECMA
        # regexes, and the published CRDs use Go's (?i).
        jsonschema.Draft7Validator(schema).validate(obj)
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- the commands the containers run -------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument text) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_arg(path: Path, name: str) -> str:
    """The default value of ``ARG name=...``."""
    (value,) = [
        rest.split("=", 1)[1]
        for word, rest in dockerfile_instructions(path)
        if word == "ARG" and rest.startswith(name + "=")
    ]
    return value


def dockerfile_exec(path: Path, instruction: str) -> list[str]:
    """The exec (JSON) form of the last ENTRYPOINT or CMD."""
    values = [rest for word, rest in dockerfile_instructions(path) if word == instruction]
    assert values, f"{path.name} has no {instruction}"
    value = json.loads(values[-1])
    assert isinstance(value, list), f"{path.name}: {instruction} must use the exec form"
    return value


def dockerfile_healthcheck(path: Path) -> list[str]:
    """The exec form after HEALTHCHECK's options."""
    (rest,) = [rest for word, rest in dockerfile_instructions(path) if word == "HEALTHCHECK"]
    return json.loads(rest.split(" CMD ", 1)[1])


def dockerfile_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions(path):
        if word == "ENV":
            env.update(dict(part.split("=", 1) for part in shlex.split(rest)))
    return env


def container_env(container: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it; a ConfigMap reference that does
    not resolve in the rendered objects fails."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in find(objs, "ConfigMap")}
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"].get("configMapKeyRef")
        if ref is None:  # a Secret: the manifests create none, so optional unless required
            secret = item["valueFrom"]["secretKeyRef"]
            assert secret.get("optional") or secret["name"] in REQUIRED_SECRETS, item
            continue
        assert ref["name"] in config_maps, f"env {item['name']}: no ConfigMap {ref['name']}"
        env[item["name"]] = config_maps[ref["name"]][ref["key"]]
    return env


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args ($$ escapes, unknown stays)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


def _shell_expand(word: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"${name} is not in the container's environment"
        return env[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, word)


def _image_name(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def vllm_serve_argv(container: dict[str, Any], objs: list[dict[str, Any]]) -> list[str] | None:
    """The `vllm serve` arguments this container runs, or None when it does not run vLLM's
    server (a Ray worker). Follows the image's ENTRYPOINT when the manifest sets only args."""
    from vllm_dflash import assets

    env = container_env(container, objs)
    dockerfile = IMAGES[_image_name(container["image"])]
    env = dockerfile_env(dockerfile) | env
    command = container.get("command") or dockerfile_exec(dockerfile, "ENTRYPOINT")
    args = container.get("args", [] if "command" in container else None)
    if args is None:
        args = dockerfile_exec(dockerfile, "CMD")
    argv = [_kubelet_expand(a, env) for a in [*command, *args]]
    if argv[:2] == ["vllm", "serve"]:
        return argv[2:]
    if argv[:2] == ["vllm-dflash", "serve-default"]:
        return assets.serve_args(argv[2:])
    if argv[:2] == ["/bin/bash", "-c"]:
        script = re.sub(r"\\\n", " ", argv[2])
        lines = [ln.strip() for ln in script.splitlines()]
        serve = [ln for ln in lines if ln.startswith(("exec vllm serve ", "vllm serve "))]
        if not serve:
            return None
        words = shlex.split(serve[-1].removeprefix("exec "))
        return [_shell_expand(w, env) for w in words[2:]]
    raise AssertionError(f"container {container['name']} runs {argv[:2]}: not vLLM's server")


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str], dict]]:
    """(label, pod labels, pod spec) of every workload: Deployments and LeaderWorkerSet
    templates. A LeaderWorkerSet's pods also carry the label its controller adds."""
    out = []
    for d in find(objs, "Deployment"):
        tmpl = d["spec"]["template"]
        label = f"Deployment/{d['metadata']['name']}"
        out.append((label, tmpl["metadata"]["labels"], tmpl["spec"]))
    for lws in find(objs, "LeaderWorkerSet"):
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        group = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
        for role in ("leaderTemplate", "workerTemplate"):
            if role in tmpl:
                labels = tmpl[role].get("metadata", {}).get("labels", {}) | group
                out.append((f"LeaderWorkerSet/{role}", labels, tmpl[role]["spec"]))
    return out


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(label, pod spec) of every workload."""
    return [(label, spec) for label, _, spec in pod_templates(objs)]


# --- the "restricted" Pod Security Standard (Kubernetes' pod-security admission) -----------
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks the "restricted" Pod Security Standard, or our additions to it
    (no service-account token, a read-only root filesystem); [] when it meets them."""
    out = []
    pod = spec.get("securityContext", {})
    if spec.get("automountServiceAccountToken") is not False:
        out.append("automountServiceAccountToken is not false")
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(f"{host} is set")
    for v in spec.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {kind} is not allowed")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        where = f"container {c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            out.append(f"{where}: capabilities do not drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities")
        if not sc.get("runAsNonRoot", pod.get("runAsNonRoot")):
            out.append(f"{where}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod.get("runAsUser")) == 0:
            out.append(f"{where}: runs as uid 0")
        seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile is {seccomp}, not RuntimeDefault")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: the root filesystem is writable")
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        ok = {
            "In": present and labels[e["key"]] in e.get("values", []),
            "NotIn": not present or labels[e["key"]] not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def parse_vllm_serve(argv: list[str]) -> tuple[Any, Any]:
    """(namespace, EngineArgs) from vLLM's own `vllm serve` parser and its pre-start checks;
    a rejected argument raises ValueError with argparse's message."""
    import contextlib
    import io

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["serve", *argv])
    except SystemExit:
        raise ValueError(f"`vllm serve` rejects {argv}:\n{err.getvalue()}") from None
    serve.validate(args)
    if args.model_tag is not None:  # as ServeSubcommand.cmd does
        args.model = args.model_tag
    return args, EngineArgs.from_cli_args(args)


# --- NetworkPolicies, evaluated as the cluster would (one namespace) ------------------------
def admits(
    policies: list[dict[str, Any]],
    pod: tuple[dict[str, str], dict[str, Any]],
    peer: tuple[dict[str, str], dict[str, str] | None],
    port: int,
) -> bool:
    """Whether ingress to ``port`` of ``pod`` (its labels, its spec) is allowed from ``peer``
    (its namespace's labels; its pod labels, None for "any pod there"). A pod no policy
    selects admits everything; policies add up."""
    labels, spec = pod
    ns_labels, peer_labels = peer
    named = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
    mine = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not mine:
        return True
    same_ns = ns_labels.get("kubernetes.io/metadata.name") == "default"
    for p in mine:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(named.get(q["port"], q["port"]) == port for q in ports):
                continue
            if "from" not in rule:
                return True
            for f in rule["from"]:
                assert "ipBlock" not in f, "ipBlock peers are not checked here"
                ns_ok = (
                    selects(f["namespaceSelector"], ns_labels)
                    if "namespaceSelector" in f
                    else same_ns
                )
                pod_ok = "podSelector" not in f or (
                    peer_labels is not None and selects(f["podSelector"], peer_labels)
                )
                if ns_ok and pod_ok:
                    return True
    return False
