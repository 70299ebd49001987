"""The Kubernetes monitoring objects that carry our alert rules and Grafana dashboard,
generated from the files the rest of the project tests, so there is no hand-kept copy:

    python -m vllm_dflash.observability.k8s_monitoring           # rewrite the two manifests
    python -m vllm_dflash.observability.k8s_monitoring --check   # exit 1 when one is stale

* ``prometheusrule.yaml``: a Prometheus Operator ``PrometheusRule`` whose ``spec`` is
  ``deploy/prometheus/dflash-alerts.yaml`` (the file promtool checks and unit-tests);
* ``grafana-dashboard.yaml``: a ConfigMap holding ``grafana/dflash-dashboard.json``, labelled
  for the Grafana sidecar's dashboard discovery (kube-prometheus-stack's default label).

Both land in ``deploy/k8s/components/monitoring/`` next to the hand-written ServiceMonitor.
Needs PyYAML (``pip install 'vllm-dflash[dev]'``; vLLM installs it too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "dflash-alerts.yaml"
DASHBOARD = ROOT / "grafana" / "dflash-dashboard.json"
OUT_DIR = ROOT / "deploy" / "k8s" / "components" / "monitoring"
NAME = "vllm-dflash"
# The label kube-prometheus-stack's Grafana sidecar looks for (sidecar.dashboards.label).
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
DASHBOARD_KEY = "vllm-dflash.json"


def prometheus_rule() -> dict[str, Any]:
    import yaml

    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": NAME},
        "spec": yaml.safe_load(RULES.read_text()),
    }


def dashboard_config_map() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{NAME}-grafana-dashboard", "labels": DASHBOARD_LABEL},
        "data": {DASHBOARD_KEY: DASHBOARD.read_text()},
    }


def _dump(obj: dict[str, Any], source: Path) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        # Multi-line strings (PromQL, the dashboard JSON) as readable block scalars.
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    header = (
        f"# Generated from {source.relative_to(ROOT)} by `make manifests` "
        f"(python -m {__spec__.name}); do not edit.\n"
    )
    return header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def render() -> dict[Path, str]:
    return {
        OUT_DIR / "prometheusrule.yaml": _dump(prometheus_rule(), RULES),
        OUT_DIR / "grafana-dashboard.yaml": _dump(dashboard_config_map(), DASHBOARD),
    }


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a manifest is not up to date")
    args = ap.parse_args(argv)
    stale = []
    for path, text in render().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.write_text(text)
        print(f"wrote {_show(path)}")
    if stale:
        names = ", ".join(_show(p) for p in stale)
        print(f"{names} stale. Fix: make manifests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
