"""The deployment files are valid as their tools read them: promtool, docker-compose, kustomize and the k8s schemas."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.prometheus import render_adapter_query

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "multi-gpu")
BIN = Path(sys.executable).parent
KEDA = DEPLOY / "k8s/autoscaling/keda"
ADAPTER_RULES = DEPLOY / "k8s/autoscaling/prometheus-adapter-rules.yaml"


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
    return render_folder(DEPLOY / "k8s/overlays" / overlay)


def render_folder(folder: Path) -> list[dict[str, Any]]:
    result = run(tool("kubectl"), "kustomize", str(folder))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(documents: list[dict[str, Any]], path: Path) -> None:
    """Against the Kubernetes schemas; custom resources (ServiceMonitor, ScaledObject) are skipped with a warning."""
    path.write_text(yaml.safe_dump_all(documents))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


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
    validate(documents, tmp_path / f"{overlay}.yaml")


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


def hpa_targets(documents: list[dict[str, Any]]) -> dict[str, str]:
    """The HPA's per-pod metrics: name -> target average value."""
    hpa = next(doc for doc in documents if doc["kind"] == "HorizontalPodAutoscaler")
    return {
        metric["pods"]["metric"]["name"]: metric["pods"]["target"]["averageValue"] for metric in hpa["spec"]["metrics"]
    }


def adapter_rules() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ADAPTER_RULES.read_text())["rules"])


def test_every_hpa_metric_is_served_per_pod_by_a_prometheus_adapter_rule() -> None:
    rules = {rule["name"]["as"]: rule for rule in adapter_rules()}
    targets = hpa_targets(render("cpu"))
    assert set(targets) == {"phasescope_headroom_used_ratio", "phasescope_engine_requests_waiting"}
    for name in targets:
        rule = rules[name]
        # The custom-metrics API finds a pod's series by these two labels.
        assert 'namespace!=""' in rule["seriesQuery"], name
        assert 'pod!=""' in rule["seriesQuery"], name
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.fullmatch(rule["name"]["matches"], rule["seriesQuery"].split("{")[0]), name
        assert "<<.LabelMatchers>>" in rule["metricsQuery"], name
        assert "<<.GroupBy>>" in rule["metricsQuery"], name


def scaled_object(documents: list[dict[str, Any]]) -> dict[str, Any]:
    return next(doc for doc in documents if doc["kind"] == "ScaledObject")


def test_keda_overlay_replaces_the_hpa_with_a_scaled_object_on_the_same_signals(tmp_path: Path) -> None:
    documents = render("gpu-keda")
    kinds = [doc["kind"] for doc in documents]
    # KEDA owns an HPA of its own: a second one on the Deployment would fight it.
    assert "HorizontalPodAutoscaler" not in kinds
    assert kinds.count("ScaledObject") == 1
    validate(documents, tmp_path / "gpu-keda.yaml")
    scaler = scaled_object(documents)
    # ScaledObject is KEDA's custom resource, which kubernetes-validate has no schema for: its shape here.
    assert scaler["apiVersion"] == "keda.sh/v1alpha1"
    target = scaler["spec"]["scaleTargetRef"]
    deployment_name = next(doc for doc in documents if doc["kind"] == "Deployment")["metadata"]["name"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment"), target["name"]) == (
        "apps/v1",
        "Deployment",
        deployment_name,
    )
    replaced = render("gpu")
    base = next(doc for doc in replaced if doc["kind"] == "HorizontalPodAutoscaler")["spec"]
    spec = scaler["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (base["minReplicas"], base["maxReplicas"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == base["behavior"]
    # Each of the HPA's signals, with the same target per replica.
    targets = hpa_targets(replaced)
    triggers = {trigger["name"]: trigger for trigger in spec["triggers"]}
    assert len(triggers) == len(spec["triggers"])
    assert set(triggers) == set(targets)
    for name, average in targets.items():
        trigger = triggers[name]
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") == "AverageValue"
        metadata = trigger["metadata"]
        assert set(metadata) >= {"serverAddress", "query", "threshold"}
        assert re.fullmatch(r"https?://[\w.-]+(:\d+)?/?", metadata["serverAddress"]), metadata["serverAddress"]
        # The CRD types trigger metadata as a map of strings: an unquoted number is refused.
        assert all(isinstance(value, str) for value in metadata.values()), metadata
        assert float(metadata["threshold"]) == float(average) > 0, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_keda_component_composes_with_every_overlay(overlay: str, tmp_path: Path) -> None:
    # kustomize takes relative paths only.
    folder = tmp_path / "keda"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY / "k8s/overlays" / overlay, folder)],
                "components": [os.path.relpath(KEDA, folder)],
            }
        )
    )
    kinds = [doc["kind"] for doc in render_folder(folder)]
    assert "HorizontalPodAutoscaler" not in kinds
    assert kinds.count("ScaledObject") == kinds.count("Deployment") == 1


def autoscaling_queries() -> dict[str, str]:
    """Every PromQL expression the autoscalers send: KEDA's as written, the adapter's as it renders them."""
    queries = {
        f"keda {trigger['name']}": trigger["metadata"]["query"]
        for trigger in scaled_object(render("gpu-keda"))["spec"]["triggers"]
    }
    for rule in adapter_rules():
        name = rule["name"]["as"]
        queries[f"adapter {name} seriesQuery"] = rule["seriesQuery"]
        queries[f"adapter {name} metricsQuery"] = render_adapter_query(
            rule["metricsQuery"], rule["seriesQuery"].split("{")[0], 'namespace="ns",pod=~"a|b"', "pod"
        )
    return queries


def test_autoscaling_queries_parse_as_promql(tmp_path: Path) -> None:
    # promtool parses recording rules offline; the live Prometheus test evaluates the same queries.
    rules = {
        "groups": [
            {
                "name": "autoscaling",
                "rules": [
                    {"record": f"autoscaling:query_{index}", "expr": expr}
                    for index, expr in enumerate(autoscaling_queries().values())
                ],
            }
        ]
    }
    path = tmp_path / "autoscaling.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", sorted((DEPLOY / "docker").glob("Dockerfile.*")), ids=lambda path: path.name)
def test_every_path_a_dockerfile_copies_exists_and_the_package_is_among_them(dockerfile: Path) -> None:
    # Guards the image build against a tree that moved (the package once lived in server/ and telemetry/).
    copied = [
        source
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
        if not source.startswith("--")
    ]
    assert "phasescope" in copied
    missing = [source for source in copied if not (ROOT / source).exists()]
    assert not missing, f"{dockerfile.name} copies paths that are not in the tree: {missing}"
