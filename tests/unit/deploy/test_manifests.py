"""The deployment files are valid as their tools read them: promtool, docker-compose, kustomize and the k8s schemas."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from phasescope.engine.default_model import DEFAULT_MODEL_NAME
from phasescope.serve.config import Settings
from support.prometheus import render_adapter_query

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "multi-gpu")
BIN = Path(sys.executable).parent
KEDA = DEPLOY / "k8s/autoscaling/keda"
ADAPTER_RULES = DEPLOY / "k8s/autoscaling/prometheus-adapter-rules.yaml"
COMPOSE = DEPLOY / "compose/docker-compose.yml"
COMPOSE_PD = DEPLOY / "compose/docker-compose.pd.yml"
DASHBOARD = DEPLOY / "grafana/dashboards/phasescope.json"
# The rendered objects: the workers' (the base) and the gateway's (the gateway component).
WORKER = "phasescope"
GATEWAY = "phasescope-gateway"
# The console script the smg wheel installs, which the gateway containers run.
GATEWAY_SCRIPT = "smg"


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


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.pd.yml"])
def test_prometheus_config_is_valid(config: str) -> None:
    result = run(tool("promtool"), "check", "config", f"prometheus/{config}")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("compose", [COMPOSE, COMPOSE_PD], ids=lambda path: path.name)
def test_compose_file_parses(compose: Path) -> None:
    result = run(tool("docker-compose"), "-f", str(compose), "config", "-q")
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


def named(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in documents if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def deployment(overlay: str, name: str = WORKER) -> dict[str, Any]:
    return named(render(overlay), "Deployment", name)


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
    service = named(render("cpu"), "Service", WORKER)
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9400}


def test_prometheus_rule_carries_the_same_groups_as_alerts_yml() -> None:
    rule = next(doc for doc in render("cpu") if doc["kind"] == "PrometheusRule")
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def dashboard_panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text())["panels"])


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


def test_dashboard_queries_use_only_metrics_the_server_exports() -> None:
    # As the tables write them: `name` or `name{labels}`.
    documented = set(re.findall(r"`(phasescope_\w+)[`{]", (ROOT / "docs/metrics.md").read_text()))
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


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids), sorted(ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


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
    deployment_name = named(documents, "Deployment", WORKER)["metadata"]["name"]
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
    documents = render_folder(folder)
    kinds = [doc["kind"] for doc in documents]
    assert "HorizontalPodAutoscaler" not in kinds
    assert kinds.count("ScaledObject") == 1
    # It scales the workers; the gateway keeps its own replica count.
    assert {doc["metadata"]["name"] for doc in documents if doc["kind"] == "Deployment"} == {WORKER, GATEWAY}
    assert scaled_object(documents)["spec"]["scaleTargetRef"]["name"] == WORKER


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


# The smg gateway: the fleet's front door, in compose and in every overlay.


def launch_flags(args: list[str]) -> dict[str, list[str]]:
    """`smg launch`'s arguments as flag -> values: `--flag=value`, `--flag value ...` and bare
    switches (no values); a repeated flag extends its values, as smg's launcher reads them."""
    assert args[:1] == ["launch"], args
    flags: dict[str, list[str]] = {}
    current = None
    for arg in args[1:]:
        if arg.startswith("--"):
            current, has_value, value = arg.partition("=")
            flags.setdefault(current, [])
            if has_value:
                flags[current].append(value)
        else:
            assert current is not None, f"{arg} follows no flag"
            flags[current].append(arg)
    return flags


def serve_flag(args: list[str], name: str) -> str | None:
    """One `phasescope serve` flag's value, given as `--name=value` or `--name value`."""
    for index, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[index + 1]
    return None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def container_port(container: dict[str, Any], name: str) -> int:
    return int(next(port["containerPort"] for port in container["ports"] if port["name"] == name))


def test_the_gateway_is_the_smg_wheels_console_script_and_every_image_installs_it() -> None:
    scripts = {
        entry.name: entry.value
        for entry in importlib.metadata.distribution("smg").entry_points
        if entry.group == "console_scripts"
    }
    assert scripts.get(GATEWAY_SCRIPT) == "smg.cli:main", scripts
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.fullmatch(r"smg\s*(==.*)?", requirement) for requirement in extras["gateway"]), extras["gateway"]
    for dockerfile in sorted((DEPLOY / "docker").glob("Dockerfile.*")):
        installed = re.findall(r"pip install [^&\n]*'\.\[([\w,-]+)\]'", dockerfile.read_text())
        assert installed, f"{dockerfile.name} does not install the package with extras"
        assert {"model", "gateway"} <= set(installed[0].split(",")), (dockerfile.name, installed)


def gateway_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    containers = named(documents, "Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


@pytest.mark.parametrize("overlay", [*OVERLAYS, "gpu-keda"])
def test_the_gateway_discovers_the_worker_pods_by_their_labels_on_their_grpc_port(overlay: str) -> None:
    documents = render(overlay)
    workers = named(documents, "Deployment", WORKER)
    gateway = named(documents, "Deployment", GATEWAY)
    container = gateway_container(documents)
    # The workers' image, run as smg instead of `phasescope serve`.
    worker_container = workers["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == worker_container["image"]
    assert container["command"] == [GATEWAY_SCRIPT]
    flags = launch_flags(container["args"])
    assert "--service-discovery" in flags or flags.get("--discovery-provider") == ["kubernetes"], flags
    assert "--worker-urls" not in flags  # discovered, not listed
    selector = dict(pair.split("=", 1) for value in flags["--selector"] for pair in value.split())
    # Exactly the worker pods: every pod of the worker Deployment, and not the gateway's own.
    assert selects(selector, pod_labels(workers)), (selector, pod_labels(workers))
    assert not selects(selector, pod_labels(gateway)), (selector, pod_labels(gateway))
    assert flags["--service-discovery-port"] == [str(container_port(worker_container, "grpc"))]
    # Its own namespace, from the downward API: the namespaced Role covers it.
    assert flags["--service-discovery-namespace"] == ["$(POD_NAMESPACE)"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Routed by the workers' GetLoads; the tokenizer comes from the worker (GetTokenizer) unless
    # its folder is in the image, so autoload stays on.
    assert flags["--policy"] == ["least_load"]
    assert "--disable-tokenizer-autoload" not in flags
    # Each Service reaches its own pods only.
    services = {name: named(documents, "Service", name)["spec"]["selector"] for name in (WORKER, GATEWAY)}
    assert selects(services[GATEWAY], pod_labels(gateway))
    assert not selects(services[GATEWAY], pod_labels(workers))
    assert selects(services[WORKER], pod_labels(workers))
    assert not selects(services[WORKER], pod_labels(gateway))


@pytest.mark.parametrize("overlay", [*OVERLAYS, "pd"])
def test_the_gateways_role_lets_it_list_and_watch_pods_in_its_namespace(overlay: str) -> None:
    documents = render(overlay)
    account = named(documents, "Deployment", GATEWAY)["spec"]["template"]["spec"]["serviceAccountName"]
    named(documents, "ServiceAccount", account)
    bindings = [
        doc
        for doc in documents
        if doc["kind"] == "RoleBinding"
        and any(subject["kind"] == "ServiceAccount" and subject["name"] == account for subject in doc["subjects"])
    ]
    assert bindings, f"no RoleBinding for {account}"
    verbs: set[str] = set()
    for binding in bindings:
        # A RoleBinding's ServiceAccount subject without a namespace is the binding's own namespace.
        assert all("namespace" not in subject for subject in binding["subjects"]), binding["subjects"]
        reference = binding["roleRef"]
        assert (reference["apiGroup"], reference["kind"]) == ("rbac.authorization.k8s.io", "Role")
        for rule in named(documents, "Role", reference["name"])["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                verbs |= set(rule["verbs"])
    assert {"list", "watch"} <= verbs, verbs
    # Nothing cluster-wide: discovery watches one namespace.
    assert not {"ClusterRole", "ClusterRoleBinding"} & {doc["kind"] for doc in documents}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "pd"])
def test_the_gateway_probes_its_own_health_listener_and_serves_http_on_its_service(overlay: str) -> None:
    documents = render(overlay)
    pod = named(documents, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    container = gateway_container(documents)
    flags = launch_flags(container["args"])
    health = int(flags["--health-check-port"][0])
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        action = container[probe]["httpGet"]
        port = action["port"] if isinstance(action["port"], int) else container_port(container, action["port"])
        assert (action["path"], port) == (path, health), probe
    assert container_port(container, "http") == int(flags["--port"][0])
    assert container_port(container, "metrics") == int(flags["--prometheus-port"][0])
    service = named(documents, "Service", GATEWAY)
    assert {port["name"]: (port["port"], port["targetPort"]) for port in service["spec"]["ports"]} == {
        "http": (30000, "http"),
        "metrics": (container_port(container, "metrics"), "metrics"),
    }
    assert pod["terminationGracePeriodSeconds"] > int(flags["--shutdown-grace-period-secs"][0])
    resources = container["resources"]
    assert resources["requests"]["cpu"]
    assert resources["limits"]["memory"]
    assert not any("nvidia.com/gpu" in resources.get(part, {}) for part in ("requests", "limits"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_is_scraped_by_one_service_monitor_and_every_worker_pod_by_the_base_one(overlay: str) -> None:
    documents = render(overlay)
    monitors = [doc for doc in documents if doc["kind"] == "ServiceMonitor"]
    services = [doc for doc in documents if doc["kind"] == "Service"]
    for service in services:
        scraping = [m for m in monitors if selects(m["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])]
        assert len(scraping) == 1, (service["metadata"]["name"], [m["metadata"]["name"] for m in scraping])
    worker_service = named(documents, "Service", WORKER)
    monitor = named(documents, "ServiceMonitor", WORKER)
    assert selects(monitor["spec"]["selector"]["matchLabels"], worker_service["metadata"]["labels"])
    assert selects(worker_service["spec"]["selector"], pod_labels(named(documents, "Deployment", WORKER)))
    metrics = next(port for port in worker_service["spec"]["ports"] if port["name"] == "metrics")
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == ["metrics"]
    worker_container = named(documents, "Deployment", WORKER)["spec"]["template"]["spec"]["containers"][0]
    assert container_port(worker_container, metrics["targetPort"]) == int(
        serve_flag(worker_container["args"], "--metrics-port") or Settings.model_fields["metrics_port"].default
    )


def compose_config(compose: Path = COMPOSE) -> dict[str, Any]:
    """A compose file as docker-compose reads it (normalised: `depends_on` with conditions, ports as maps)."""
    result = run(tool("docker-compose"), "-f", str(compose), "config")
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(yaml.safe_load(result.stdout))


def test_compose_fronts_the_worker_services_it_defines_with_the_gateway() -> None:
    services = compose_config()["services"]
    gateway = services["gateway"]
    assert gateway["entrypoint"] == [GATEWAY_SCRIPT]
    flags = launch_flags(gateway["command"])
    assert flags["--worker-urls"], "no --worker-urls"
    scraped = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    jobs = [job for job in scraped if job["job_name"] == "phasescope"]
    targets = {target for job in jobs for config in job["static_configs"] for target in config["targets"]}
    for url in flags["--worker-urls"]:
        address = urllib.parse.urlsplit(url)
        assert address.scheme == "grpc", url
        assert address.hostname in services, f"{url} names no service of the compose file"
        worker = services[address.hostname]
        assert worker["image"] == gateway["image"]  # the same image, another entrypoint
        command = [str(arg) for arg in worker.get("command", [])]
        assert address.port == int(serve_flag(command, "--port") or Settings.model_fields["port"].default), url
        if "healthcheck" in worker:
            assert gateway["depends_on"][address.hostname]["condition"] == "service_healthy"
        # Prometheus keeps scraping every worker.
        metrics = int(serve_flag(command, "--metrics-port") or Settings.model_fields["metrics_port"].default)
        assert f"{address.hostname}:{metrics}" in targets, (address.hostname, targets)
    # The default model's folder, which the image prepared under its PHASESCOPE_CACHE_DIR.
    cache = re.search(r"PHASESCOPE_CACHE_DIR=(\S+)", (DEPLOY / "docker/Dockerfile.cpu").read_text())
    assert cache, "Dockerfile.cpu sets no PHASESCOPE_CACHE_DIR"
    assert flags["--tokenizer-path"] == [f"{cache.group(1)}/models/{DEFAULT_MODEL_NAME}"]
    assert flags["--policy"] == ["least_load"]
    published = {int(port["target"]): int(port["published"]) for port in gateway["ports"]}
    assert published == {int(flags["--port"][0]): 30000}


def smg_reads(args: list[str]) -> Any:
    """`smg launch ...` as smg's own launcher reads it (it exits on an unknown flag or a bad value),
    checked as the launcher checks it before it starts the router."""
    from smg.launch_router import parse_router_args  # type: ignore[import-untyped]  # no type information

    assert args[:1] == ["launch"], args
    router_args = parse_router_args(args[1:])
    router_args._validate_router_args()
    return router_args


def test_smg_reads_the_gateways_arguments_as_the_tests_read_them() -> None:
    args = gateway_container(render("cpu"))["args"]
    flags = launch_flags(args)
    discovered = smg_reads(args)
    assert discovered.selected_discovery_provider() == "kubernetes"
    assert discovered.selector == dict(value.split("=", 1) for value in flags["--selector"])
    assert discovered.service_discovery_namespace == flags["--service-discovery-namespace"][0]
    assert discovered.service_discovery_port == int(flags["--service-discovery-port"][0])
    assert (discovered.policy, discovered.port, discovered.health_check_port, discovered.prometheus_port) == (
        flags["--policy"][0],
        int(flags["--port"][0]),
        int(flags["--health-check-port"][0]),
        int(flags["--prometheus-port"][0]),
    )
    assert discovered.worker_urls == []
    assert discovered.tokenizer_path is None
    assert discovered.model_path is None
    assert not discovered.disable_tokenizer_autoload
    command = [str(arg) for arg in compose_config()["services"]["gateway"]["command"]]
    flags = launch_flags(command)
    listed = smg_reads(command)
    assert listed.selected_discovery_provider() is None
    assert listed.worker_urls == flags["--worker-urls"]
    assert listed.tokenizer_path == flags["--tokenizer-path"][0]
    assert (listed.policy, listed.port) == (flags["--policy"][0], int(flags["--port"][0]))


# Disaggregated prefill and decode (docs/disaggregation.md): the `pd` overlay and the compose variant.

PD = "pd"
# Each pool's name suffix and pod label value -> the role its KV connector plays.
POOLS = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROLE_LABEL = "phasescope.io/role"
# vLLM's connector that keeps each prompt's KV as files in a folder (shared_storage_path).
SHARED_FOLDER_CONNECTOR = "ExampleConnector"
# A pod annotation smg would read in place of the connector a worker reports in GetServerInfo.
KV_CONNECTOR_ANNOTATION = "smg.ai/kv-connector"


def kv_transfer_config(args: list[str]) -> dict[str, Any]:
    value = serve_flag(args, "--kv-transfer-config")
    assert value, f"no --kv-transfer-config in {args}"
    config = json.loads(value)
    assert isinstance(config, dict), value
    return config


def pool(documents: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return named(documents, "Deployment", f"{WORKER}-{role}")


def selector_flag(flags: dict[str, list[str]], name: str) -> dict[str, str]:
    """A repeated `--*-selector key=value` flag as smg's launcher reads it (an item may hold several pairs)."""
    return dict(pair.split("=", 1) for value in flags[name] for pair in value.split())


def test_the_pd_overlay_renders_two_worker_pools_and_the_gateway_and_validates(tmp_path: Path) -> None:
    documents = render(PD)
    validate(documents, tmp_path / "pd.yaml")
    deployments = {doc["metadata"]["name"] for doc in documents if doc["kind"] == "Deployment"}
    assert deployments == {f"{WORKER}-{role}" for role in POOLS} | {GATEWAY}
    # One copy of the alerts and one ServiceMonitor for the workers, whatever the number of pools.
    assert [doc["metadata"]["name"] for doc in documents if doc["kind"] == "PrometheusRule"] == [WORKER]
    assert sorted(doc["metadata"]["name"] for doc in documents if doc["kind"] == "ServiceMonitor") == [WORKER, GATEWAY]
    assert "ScaledObject" not in {doc["kind"] for doc in documents}


@pytest.mark.parametrize("role", POOLS)
def test_each_pd_pool_is_the_cpu_overlays_worker_with_its_role_label_and_kv_connector(role: str) -> None:
    documents = render(PD)
    deployment = pool(documents, role)
    labels = pod_labels(deployment)
    assert labels[ROLE_LABEL] == role
    assert deployment["spec"]["selector"]["matchLabels"][ROLE_LABEL] == role
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    # smg takes the connector from the worker's GetServerInfo; an annotation would override it.
    assert KV_CONNECTOR_ANNOTATION not in deployment["spec"]["template"]["metadata"].get("annotations", {})
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = kv_transfer_config(container["args"])
    assert config["kv_connector"] == SHARED_FOLDER_CONNECTOR
    assert config["kv_role"] == POOLS[role]
    # Otherwise the cpu overlay's worker: image, settings, probes, ports, resources and grace.
    cpu = named(render("cpu"), "Deployment", WORKER)
    cpu_pod = cpu["spec"]["template"]["spec"]
    cpu_container = cpu_pod["containers"][0]
    assert [arg for arg in container["args"] if not arg.startswith("--kv-transfer-config")] == cpu_container["args"]
    kv_store = config["kv_connector_extra_config"]["shared_storage_path"]
    assert [m for m in container["volumeMounts"] if m["mountPath"] != kv_store] == cpu_container["volumeMounts"]
    for field in ("image", "env", "ports", "resources", "startupProbe", "readinessProbe", "livenessProbe"):
        assert container[field] == cpu_container[field], field
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == cpu_pod["terminationGracePeriodSeconds"]
    assert deployment["spec"]["strategy"] == cpu["spec"]["strategy"]


def test_the_pd_pools_connectors_share_one_read_write_many_volume_the_images_user_can_write() -> None:
    documents = render(PD)
    pods = {role: pool(documents, role)["spec"]["template"]["spec"] for role in POOLS}
    configs = {role: kv_transfer_config(pod["containers"][0]["args"]) for role, pod in pods.items()}
    # The same connector and folder, only the role differs.
    assert len({json.dumps({**config, "kv_role": None}, sort_keys=True) for config in configs.values()}) == 1
    # The image runs as 1000:1000 (Dockerfile.cpu); the group owns the store where Kubernetes manages it.
    user = re.search(r"^USER (\d+):(\d+)$", (DEPLOY / "docker/Dockerfile.cpu").read_text(), re.MULTILINE)
    assert user, "Dockerfile.cpu sets no USER uid:gid"
    claims: set[str] = set()
    for role, config in configs.items():
        pod = pods[role]
        (mount,) = [
            m
            for m in pod["containers"][0]["volumeMounts"]
            if m["mountPath"] == config["kv_connector_extra_config"]["shared_storage_path"]
        ]
        assert not mount.get("readOnly"), role
        (volume,) = [volume for volume in pod["volumes"] if volume["name"] == mount["name"]]
        claims.add(volume["persistentVolumeClaim"]["claimName"])
        assert pod["securityContext"]["fsGroup"] == int(user.group(2)), role
    (claim,) = claims
    assert named(documents, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]


def test_each_pd_pool_has_its_own_service_disruption_budget_and_autoscaler() -> None:
    documents = render(PD)
    gateway = named(documents, "Deployment", GATEWAY)
    for role in POOLS:
        name = f"{WORKER}-{role}"
        own = pod_labels(pool(documents, role))
        others = [pod_labels(pool(documents, other)) for other in POOLS if other != role] + [pod_labels(gateway)]
        service = named(documents, "Service", name)["spec"]["selector"]
        budget = named(documents, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"]
        for selector in (service, budget):
            assert selects(selector, own), (name, selector)
            assert not any(selects(selector, labels) for labels in others), (name, selector)
        target = named(documents, "HorizontalPodAutoscaler", name)["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)


def test_one_service_monitor_scrapes_both_pd_pools_under_the_job_the_alerts_select() -> None:
    documents = render(PD)
    monitors = [doc for doc in documents if doc["kind"] == "ServiceMonitor"]
    for service in (doc for doc in documents if doc["kind"] == "Service"):
        scraping = [m for m in monitors if selects(m["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])]
        assert len(scraping) == 1, (service["metadata"]["name"], [m["metadata"]["name"] for m in scraping])
    monitor = named(documents, "ServiceMonitor", WORKER)
    alerts = (DEPLOY / "prometheus/alerts.yml").read_text()
    assert 'job="phasescope"' in alerts
    for role in POOLS:
        service = named(documents, "Service", f"{WORKER}-{role}")
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]), role
        # Prometheus Operator names the job after the Service unless jobLabel names one of its labels.
        assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "phasescope", role
    rule = named(documents, "PrometheusRule", WORKER)
    assert rule["spec"]["groups"] == yaml.safe_load(alerts)["groups"]


def test_the_pd_gateway_finds_each_pool_by_its_role_label_through_kubernetes_discovery() -> None:
    documents = render(PD)
    gateway = named(documents, "Deployment", GATEWAY)
    container = gateway_container(documents)
    assert container["command"] == [GATEWAY_SCRIPT]
    flags = launch_flags(container["args"])
    assert "--pd-disaggregation" in flags
    assert "--service-discovery" in flags or flags.get("--discovery-provider") == ["kubernetes"], flags
    # Discovered, not listed; and no worker selector outside the two pools'.
    assert not {"--worker-urls", "--prefill", "--decode", "--selector"} & set(flags), flags
    for role in POOLS:
        selector = selector_flag(flags, f"--{role}-selector")
        assert selector[ROLE_LABEL] == role
        deployment = pool(documents, role)
        assert selects(selector, pod_labels(deployment)), (role, selector)
        others = [pod_labels(pool(documents, other)) for other in POOLS if other != role] + [pod_labels(gateway)]
        assert not any(selects(selector, labels) for labels in others), (role, selector)
        worker_container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert flags["--service-discovery-port"] == [str(container_port(worker_container, "grpc"))], role
        assert container["image"] == worker_container["image"]
    assert flags["--service-discovery-namespace"] == ["$(POD_NAMESPACE)"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Decode pods by their GetLoads, prefill pods by the prefixes they hold.
    assert flags["--policy"] == ["least_load"]
    assert flags["--prefill-policy"] == ["cache_aware"]
    assert "--decode-policy" not in flags
    # As smg's own launcher reads them.
    parsed = smg_reads(container["args"])
    assert parsed.pd_disaggregation
    assert parsed.selected_discovery_provider() == "kubernetes"
    assert parsed.prefill_selector == selector_flag(flags, "--prefill-selector")
    assert parsed.decode_selector == selector_flag(flags, "--decode-selector")
    assert (parsed.selector, parsed.worker_urls, parsed.prefill_urls, parsed.decode_urls) == ({}, [], [], [])
    assert (parsed.policy, parsed.prefill_policy, parsed.decode_policy) == ("least_load", "cache_aware", None)
    assert parsed.kv_connector_annotation == KV_CONNECTOR_ANNOTATION


def test_compose_pd_pairs_a_prefill_and_a_decode_worker_sharing_a_kv_store_behind_smg_in_pd_mode() -> None:
    config = compose_config(COMPOSE_PD)
    services = config["services"]
    gateway = services["gateway"]
    assert gateway["entrypoint"] == [GATEWAY_SCRIPT]
    command = [str(arg) for arg in gateway["command"]]
    flags = launch_flags(command)
    assert "--pd-disaggregation" in flags
    assert "--worker-urls" not in flags
    scraped = yaml.safe_load((DEPLOY / "prometheus/prometheus.pd.yml").read_text())["scrape_configs"]
    targets = {
        target
        for job in scraped
        if job["job_name"] == "phasescope"
        for static in job["static_configs"]
        for target in static["targets"]
    }
    stores: set[tuple[str, str]] = set()
    workers: list[str] = []
    for flag, role in (("--prefill", "kv_producer"), ("--decode", "kv_consumer")):
        assert flags.get(flag), f"no {flag}"
        for url in flags[flag]:
            address = urllib.parse.urlsplit(url)
            assert address.scheme == "grpc", url
            assert address.hostname in services, f"{url} names no service of the compose file"
            worker = services[address.hostname]
            workers.append(str(address.hostname))
            assert worker["image"] == gateway["image"]
            worker_command = [str(arg) for arg in worker["command"]]
            assert address.port == int(serve_flag(worker_command, "--port") or Settings.model_fields["port"].default)
            assert gateway["depends_on"][address.hostname]["condition"] == "service_healthy"
            kv = kv_transfer_config(worker_command)
            assert (kv["kv_connector"], kv["kv_role"]) == (SHARED_FOLDER_CONNECTOR, role), address.hostname
            folder = kv["kv_connector_extra_config"]["shared_storage_path"]
            mounted = {target: source for source, target, *_ in (volume.split(":") for volume in worker["volumes"])}
            stores.add((mounted[folder], folder))
            metrics = serve_flag(worker_command, "--metrics-port") or Settings.model_fields["metrics_port"].default
            assert f"{address.hostname}:{metrics}" in targets, (address.hostname, targets)
    assert sorted(workers) == ["decode", "prefill"]
    # One named volume at one folder for both connectors.
    ((volume, folder),) = stores
    assert volume in config["volumes"]
    # The image's user owns it before either worker starts (a new volume belongs to root).
    user = re.search(r"^USER (\d+:\d+)$", (DEPLOY / "docker/Dockerfile.cpu").read_text(), re.MULTILINE)
    assert user, "Dockerfile.cpu sets no USER uid:gid"
    (init,) = [
        name
        for name, service in services.items()
        if name not in workers and any(v.split(":")[0] == volume for v in service.get("volumes", []))
    ]
    assert services[init]["entrypoint"] == ["chown", user.group(1), folder]
    for worker in workers:
        assert services[worker]["depends_on"][init]["condition"] == "service_completed_successfully"
    # As smg's own launcher reads them, with the tokenizer of the image's default model.
    parsed = smg_reads(command)
    assert parsed.pd_disaggregation
    assert parsed.selected_discovery_provider() is None
    assert parsed.prefill_urls == [(url, None) for url in flags["--prefill"]]
    assert parsed.decode_urls == flags["--decode"]
    cache = re.search(r"PHASESCOPE_CACHE_DIR=(\S+)", (DEPLOY / "docker/Dockerfile.cpu").read_text())
    assert cache, "Dockerfile.cpu sets no PHASESCOPE_CACHE_DIR"
    assert parsed.tokenizer_path == f"{cache.group(1)}/models/{DEFAULT_MODEL_NAME}"
    assert {int(port["target"]): int(port["published"]) for port in gateway["ports"]} == {parsed.port: 30000}


def test_the_documented_pd_commands_are_read_by_smg_and_phasescope() -> None:
    """docs/disaggregation.md's one-machine commands: smg's launcher and `phasescope serve` accept every flag."""
    from phasescope.cli.main import build_parser

    text = (ROOT / "docs/disaggregation.md").read_text()
    (block,) = re.findall(r"```sh\n(MODEL=.*?)```", text, re.DOTALL)
    commands = [
        shlex.split(line.replace("$MODEL", "/models/m").rstrip(" &"))
        for line in block.replace("\\\n", " ").splitlines()
    ]
    serves = [command for command in commands if command[:2] == [".venv/bin/phasescope", "serve"]]
    launches = [command for command in commands if command[:2] == [".venv/bin/smg", "launch"]]
    assert len(serves) == 2, commands
    assert len(launches) == 1, commands
    roles: dict[str, int] = {}
    for command in serves:
        args = build_parser().parse_args(command[1:])
        roles[kv_transfer_config(command)["kv_role"]] = args.port
    parsed = smg_reads(launches[0][1:])
    assert parsed.pd_disaggregation
    assert parsed.prefill_urls == [(f"grpc://127.0.0.1:{roles['kv_producer']}", None)]
    assert parsed.decode_urls == [f"grpc://127.0.0.1:{roles['kv_consumer']}"]


# Each pool's physics: every series a worker exports carries its pool's role, and the dashboard's
# "Disaggregated pools" row reads the verdicts, roofline figures and cost per pool.

# The label the scrape configs put on every series of a pool's worker; its values are POOLS' keys.
ROLE = "role"
POOL_ROW = "Disaggregated pools"
# Where Prometheus' Kubernetes service discovery puts a pod's labels (the name sanitised).
POD_LABEL_META = "__meta_kubernetes_pod_label_"


def compose_pd_scrape_roles() -> dict[str, str | None]:
    """Each target of deploy/prometheus/prometheus.pd.yml's `phasescope` job -> the role label it carries."""
    scraped = yaml.safe_load((DEPLOY / "prometheus/prometheus.pd.yml").read_text())["scrape_configs"]
    (job,) = [job for job in scraped if job["job_name"] == "phasescope"]
    return {
        target: static.get("labels", {}).get(ROLE) for static in job["static_configs"] for target in static["targets"]
    }


def test_every_worker_the_compose_pd_prometheus_scrapes_carries_its_pools_role() -> None:
    services = compose_config(COMPOSE_PD)["services"]
    roles = compose_pd_scrape_roles()
    # Both pools, and no worker without its pool's role.
    assert set(roles.values()) == set(POOLS), roles
    for target, role in roles.items():
        host, port = target.rsplit(":", 1)
        command = [str(arg) for arg in services[host]["command"]]
        metrics = serve_flag(command, "--metrics-port") or Settings.model_fields["metrics_port"].default
        assert int(port) == int(metrics), target
        # The role of the pool whose connector the worker runs.
        assert role in POOLS, target
        assert kv_transfer_config(command)["kv_role"] == POOLS[role], target


def test_the_pd_service_monitor_copies_each_pods_pool_role_onto_every_series() -> None:
    documents = render(PD)
    source = POD_LABEL_META + re.sub(r"[^a-zA-Z0-9_]", "_", ROLE_LABEL)
    # The monitoring kustomization patches the base's ServiceMonitor.
    base = named(render_folder(DEPLOY / "k8s/base"), "ServiceMonitor", WORKER)["spec"]["endpoints"]
    endpoints = named(documents, "ServiceMonitor", WORKER)["spec"]["endpoints"]
    assert len(endpoints) == len(base)
    for endpoint, base_endpoint in zip(endpoints, base, strict=True):
        relabelings = endpoint.get("relabelings", [])
        (copy,) = [relabeling for relabeling in relabelings if relabeling.get("targetLabel") == ROLE]
        # The value as it is: the default action, regex and replacement.
        assert copy["sourceLabels"] == [source], copy
        assert copy.get("action", "replace").lower() == "replace", copy
        assert (copy.get("regex", "(.*)"), copy.get("replacement", "$1")) == ("(.*)", "$1"), copy
        # The patch sets the endpoint's whole list: whatever the base's endpoint had stays.
        assert [relabeling for relabeling in relabelings if relabeling is not copy] == base_endpoint.get(
            "relabelings", []
        )
        assert {key: value for key, value in endpoint.items() if key != "relabelings"} == {
            key: value for key, value in base_endpoint.items() if key != "relabelings"
        }
    # So each pool's series read role="prefill" or role="decode".
    for role in POOLS:
        assert pod_labels(pool(documents, role))[ROLE_LABEL] == role


def pool_row() -> list[dict[str, Any]]:
    """The panels of the dashboard's "Disaggregated pools" row: those after it up to the next row."""
    panels = dashboard_panels()
    (start,) = [index for index, panel in enumerate(panels) if panel["title"].startswith(POOL_ROW)]
    row: list[dict[str, Any]] = []
    for panel in panels[start + 1 :]:
        if panel["type"] == "row":
            break
        row.append(panel)
    return row


def as_sent(expr: str) -> str:
    """A panel's expression as Grafana sends it: model `m`, every instance, a 5 m rate interval."""
    return expr.replace("$model", "m").replace("$instance", ".*").replace("$__rate_interval", "5m")


def pool_targets() -> dict[str, str]:
    """`panel title / refId` -> expression as sent, for every target of the row."""
    return {
        f"{panel['title']} / {target['refId']}": as_sent(target["expr"])
        for panel in pool_row()
        for target in panel["targets"]
    }


def pool_target(series: str, ref: str) -> str:
    """The row's target `ref` of the panel that reads `series`."""
    (panel,) = [panel for panel in pool_row() if any(series in target["expr"] for target in panel["targets"])]
    (target,) = [target for target in panel["targets"] if target["refId"] == ref]
    return as_sent(str(target["expr"]))


# A disaggregated deployment as Prometheus stores it: one prefill worker, three decode workers,
# and a worker outside the pools (no role label), whose series every panel of the row must leave out.
PREFILL, DECODES, OUTSIDE = "prefill:9400", ("decode-0:9400", "decode-1:9400", "decode-2:9400"), "solo:9400"
# What bounds each worker's phases: two of the three decode workers read memory for decode.
BOUND: dict[str, dict[str, str]] = {
    PREFILL: {"prefill": "compute", "decode": "idle"},
    DECODES[0]: {"prefill": "host", "decode": "memory"},
    DECODES[1]: {"prefill": "host", "decode": "memory"},
    DECODES[2]: {"prefill": "host", "decode": "host"},
    OUTSIDE: {"prefill": "queue", "decode": "capacity"},
}
# Each worker's (bandwidth part, MFU part) per phase.
UTILIZATION: dict[str, dict[str, tuple[float, float]]] = {
    PREFILL: {"prefill": (0.25, 0.75)},
    DECODES[0]: {"prefill": (0.125, 0.03125), "decode": (0.5, 0.0625)},
    DECODES[1]: {"prefill": (0.125, 0.03125), "decode": (0.75, 0.0625)},
    DECODES[2]: {"prefill": (0.125, 0.03125), "decode": (0.25, 0.0625)},
    OUTSIDE: {"prefill": (0.0625, 0.9375), "decode": (0.9375, 0.0625)},
}
# Each worker's (cost per million tokens, tokens/s) per phase.
COST: dict[str, dict[str, tuple[float, float]]] = {
    PREFILL: {"prefill": (0.5, 1000), "decode": (2000, 1)},
    DECODES[0]: {"prefill": (1, 100), "decode": (8, 100)},
    DECODES[1]: {"prefill": (1, 200), "decode": (4, 200)},
    DECODES[2]: {"prefill": (1, 200), "decode": (2, 200)},
    OUTSIDE: {"prefill": (64, 64), "decode": (64, 64)},
}
# FLOPs, bytes read and bytes written per second, per phase: the prefill pool's prefill above the
# ridge point (100 FLOP/byte), every decode pool phase below it.
ROOFLINE: dict[str, dict[str, tuple[float, float, float]]] = {
    PREFILL: {"prefill": (6000, 20, 10)},
    DECODES[0]: {"prefill": (300, 10, 5), "decode": (600, 250, 50)},
    DECODES[1]: {"prefill": (300, 10, 5), "decode": (600, 250, 50)},
    DECODES[2]: {"prefill": (300, 10, 5), "decode": (600, 250, 50)},
    OUTSIDE: {"prefill": (6000, 1, 1), "decode": (6000, 1, 1)},
}
VERDICTS = ("memory", "compute", "host", "queue", "idle", "capacity")


def worker_labels(instance: str, **labels: str) -> str:
    role = None if instance == OUTSIDE else "prefill" if instance == PREFILL else "decode"
    pairs = {"job": "phasescope", "instance": instance, **({ROLE: role} if role else {}), **labels}
    return "{" + ",".join(f'{key}="{value}"' for key, value in pairs.items()) + "}"


def pd_series() -> list[dict[str, str]]:
    """promtool input series: gauges constant, counters at a constant rate (per second, sampled each minute)."""
    series: list[dict[str, str]] = []

    def gauge(name: str, instance: str, value: float, **labels: str) -> None:
        series.append({"series": name + worker_labels(instance, **labels), "values": f"{value}x15"})

    def counter(name: str, instance: str, per_second: float, **labels: str) -> None:
        series.append({"series": name + worker_labels(instance, **labels), "values": f"0+{per_second * 60}x15"})

    for instance in (PREFILL, *DECODES, OUTSIDE):
        engine = {"model": "m", "engine": "0"}
        for phase, verdict in BOUND[instance].items():
            for candidate in VERDICTS:
                gauge("phasescope_bound", instance, int(candidate == verdict), **engine, phase=phase, verdict=candidate)
        for phase, (bandwidth, compute) in UTILIZATION[instance].items():
            gauge("phasescope_memory_bandwidth_utilization_ratio", instance, bandwidth, **engine, phase=phase)
            gauge("phasescope_compute_utilization_ratio", instance, compute, **engine, phase=phase)
        for phase, (price, tokens) in COST[instance].items():
            gauge("phasescope_cost_per_million_tokens", instance, price, **engine, phase=phase)
            gauge("phasescope_tokens_per_second", instance, tokens, **engine, phase=phase)
        for phase, (flops, read, written) in ROOFLINE[instance].items():
            counter("phasescope_model_flops_total", instance, flops, **engine, phase=phase)
            counter("phasescope_model_read_bytes_total", instance, read, **engine, phase=phase)
            counter("phasescope_model_written_bytes_total", instance, written, **engine, phase=phase)
        gauge("phasescope_roofline_ridge_point_flops_per_byte", instance, 100, model="m")
        # The KV transfers: the prefill pool saves the prompts' KV, the decode pool loads it.
        stage = {"model": "m", "phase": "kv_transfer"}
        for le, per_second in (("0.1", 1), ("1", 2), ("+Inf", 2)):
            counter("phasescope_request_phase_seconds_bucket", instance, per_second, **stage, le=le)
        counter("phasescope_request_phase_seconds_sum", instance, 0.5, **stage)
        counter("phasescope_request_phase_seconds_count", instance, 2, **stage)
        direction = "saved" if instance == PREFILL else "loaded"
        counter("phasescope_kv_transfer_tokens_total", instance, 768, model="m", direction=direction)
        counter("phasescope_kv_transfer_bytes_total", instance, 768 * 46080, model="m")
        counter("phasescope_tokens_total", instance, 89, model="m", phase="prefill")
        # vLLM's prompt tokens by source, under either name Prometheus may store (docs/metrics.md).
        vllm = "vllm:prompt_tokens_by_source_total" if instance == PREFILL else "vllm_prompt_tokens_by_source_total"
        counter(vllm, instance, 89, model_name="m", engine="0", source="local_compute")
        if instance != PREFILL:
            counter(vllm, instance, 768, model_name="m", engine="0", source="external_kv_transfer")
    return series


def promql_test(tmp_path: Path, expectations: dict[str, list[tuple[str, float]]]) -> None:
    """Evaluates each expression over pd_series() with promtool: its result must be exactly the samples given."""
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": pd_series(),
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "10m",
                        "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
                    }
                    for expr, samples in expectations.items()
                ],
            }
        ],
    }
    path = tmp_path / "pools.test.yml"
    path.write_text(yaml.safe_dump(tests))
    result = run(tool("promtool"), "test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_panel_of_the_pool_row_groups_by_role_and_shows_each_pool(tmp_path: Path) -> None:
    targets = pool_targets()
    assert len(targets) >= 6, targets
    # The whole deployment's figure (the cost per output token of both pools) is the one without a role.
    expectations: dict[str, list[tuple[str, float]]] = {}
    for name, expr in targets.items():
        assert f'{ROLE}!=""' in expr or f'{ROLE}="decode"' in expr, name
        pools = [(f'{{{ROLE}="{role}"}}', 1.0) for role in POOLS] if f"by ({ROLE}" in expr else [("{}", 1.0)]
        expectations[f"group by ({ROLE}) ({expr})"] = pools
    promql_test(tmp_path, expectations)


def test_the_pool_row_reads_the_prefill_pool_compute_bound_and_the_decode_pool_bandwidth_bound(
    tmp_path: Path,
) -> None:
    verdict_panel = next(panel for panel in pool_row() if panel["type"] == "state-timeline")
    codes = {
        option["text"]: int(code)
        for code, option in verdict_panel["fieldConfig"]["defaults"]["mappings"][0]["options"].items()
    }
    assert set(codes) == set(VERDICTS)
    bandwidth = pool_target("phasescope_memory_bandwidth_utilization_ratio", "A")
    compute = pool_target("phasescope_compute_utilization_ratio", "B")
    intensity = pool_target("phasescope_model_flops_total", "A")
    ridge = pool_target("phasescope_roofline_ridge_point_flops_per_byte", "B")

    def at(role: str, phase: str) -> str:
        return f'{{{ROLE}="{role}", phase="{phase}"}}'

    promql_test(
        tmp_path,
        {
            # The verdict most of each pool's engines hold, per phase.
            as_sent(verdict_panel["targets"][0]["expr"]): [
                (at("prefill", "prefill"), codes["compute"]),
                (at("prefill", "decode"), codes["idle"]),
                (at("decode", "prefill"), codes["host"]),
                (at("decode", "decode"), codes["memory"]),
            ],
            # The prefill pool's prefill uses more of its compute than of its bandwidth; the decode pool the reverse.
            f"{compute} > {bandwidth}": [(at("prefill", "prefill"), 0.75)],
            f"{bandwidth} > {compute}": [(at("decode", "prefill"), 0.125), (at("decode", "decode"), 0.5)],
            # Only the prefill pool's prefill sits above the ridge point.
            f"group by ({ROLE}, phase) ({intensity} > on ({ROLE}) group_left {ridge})": [(at("prefill", "prefill"), 1)],
            f"group by ({ROLE}, phase) ({intensity} < on ({ROLE}) group_left {ridge})": [
                (at("decode", "prefill"), 1),
                (at("decode", "decode"), 1),
            ],
            # Cost per million tokens per pool: Σ price ÷ Σ tokens over its engines; and both pools' price per
            # million tokens the decode pool generates: (500 + 2000 + 500 + 2000) ÷ 500.
            pool_target("phasescope_cost_per_million_tokens", "A"): [
                (at("prefill", "prefill"), 0.5),
                (at("prefill", "decode"), 2000),
                (at("decode", "prefill"), 1),
                (at("decode", "decode"), 4),
            ],
            pool_target("phasescope_cost_per_million_tokens", "B"): [("{}", 10)],
        },
    )
