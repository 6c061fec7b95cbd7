"""The deployment files are valid as their tools read them: promtool, docker-compose, kustomize and the k8s schemas."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "multi-gpu")
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A tool from the venv (kubectl, kubernetes-validate) or the system (promtool, docker-compose)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is not installed: run `make setup`"
    return str(path)


def run(*command: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def test_alert_rules_pass_promtool_check() -> None:
    result = run(tool("promtool"), "check", "rules", "prometheus/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_runbook_and_a_promtool_unit_test() -> None:
    rules = [
        rule
        for group in yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    ]
    tests = (DEPLOY / "prometheus/alerts.test.yml").read_text()
    for rule in rules:
        assert rule["annotations"]["runbook"], rule["alert"]
        assert f"alertname: {rule['alert']}" in tests, f"{rule['alert']} has no promtool test"
    result = run(tool("promtool"), "test", "rules", "alerts.test.yml", cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_is_valid() -> None:
    result = run(tool("promtool"), "check", "config", "prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_parses() -> None:
    result = run(tool("docker-compose"), "-f", "compose/docker-compose.yml", "config", "-q")
    assert result.returncode == 0, result.stdout + result.stderr


def render(overlay: str) -> list[dict[str, Any]]:
    result = run(tool("kubectl"), "kustomize", f"k8s/overlays/{overlay}")
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_the_kubernetes_schemas(overlay: str, tmp_path: Path) -> None:
    documents = render(overlay)
    kinds = {doc["kind"] for doc in documents}
    assert {
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    } <= kinds
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(documents))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(rendered))
    assert result.returncode == 0, result.stdout + result.stderr


def deployment(overlay: str) -> dict[str, Any]:
    return next(doc for doc in render(overlay) if doc["kind"] == "Deployment")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_standard_grpc_health_service_with_a_long_startup_budget(overlay: str) -> None:
    pod = deployment(overlay)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051, "service": ""}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # loading weights can take minutes
    assert {port["name"]: port["containerPort"] for port in container["ports"]} == {"grpc": 50051, "metrics": 9400}
    # Draining needs more time than the server's own grace period.
    grace = next(int(arg.split("=")[1]) for arg in container["args"] if arg.startswith("--shutdown-grace-seconds="))
    assert pod["terminationGracePeriodSeconds"] > grace
    shm = next(volume for volume in pod["volumes"] if volume["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(mount["mountPath"] == "/dev/shm" for mount in container["volumeMounts"])


@pytest.mark.parametrize(("overlay", "gpus"), [("gpu", "1"), ("multi-gpu", "4")])
def test_gpu_requests_equal_limits(overlay: str, gpus: str) -> None:
    container = deployment(overlay)["spec"]["template"]["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
    if overlay == "multi-gpu":
        assert "--tensor-parallel-size=4" in container["args"]


def test_service_names_its_ports() -> None:
    service = next(doc for doc in render("cpu") if doc["kind"] == "Service")
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9400}


def test_prometheus_rule_carries_the_same_groups_as_alerts_yml() -> None:
    rule = next(doc for doc in render("cpu") if doc["kind"] == "PrometheusRule")
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/phasescope.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_dashboard_queries_use_only_metrics_the_server_exports() -> None:
    documented = set(re.findall(r"`(phasescope_\w+)`", (ROOT / "docs/metrics.md").read_text()))
    # Histogram series are documented by their family name.
    suffixes = ("_bucket", "_sum", "_count")
    for expr in dashboard_expressions():
        for name in re.findall(r"\b(phasescope_\w+|vllm:\w+)", expr):
            if name.startswith("vllm:"):
                # vLLM's own series stay on /metrics; docs/metrics.md names the ones we rely on.
                assert name in (ROOT / "docs/metrics.md").read_text(), name
                continue
            family = next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name)
            assert name in documented or family in documented, f"{name} is not an exported series"
