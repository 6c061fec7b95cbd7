"""A real Prometheus scrapes the server under load; every dashboard, alert and autoscaler query evaluates against it."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from phasescope.client.client import Client, build_request
from support.prometheus import PrometheusServer, render_adapter_query
from support.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "phasescope.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCALED_OBJECT = ROOT / "deploy" / "k8s" / "autoscaling" / "keda" / "scaledobject.yaml"
ADAPTER_RULES = ROOT / "deploy" / "k8s" / "autoscaling" / "prometheus-adapter-rules.yaml"
# Series that exist only on Hopper-or-newer GPUs (NVML GPM): absent, by design, on CI.
GPU_ONLY = re.compile(r"phasescope_gpu_")
# Series only a server with --speculative-config has (tests/integration/test_speculative.py serves one).
SPECULATION_ONLY = re.compile(r"phasescope_speculative_")
# Series only a worker of a disaggregated pool has: the pool's `role` label, which the PD scrape
# configs add (deploy/prometheus/prometheus.pd.yml, the pd overlay's ServiceMonitor), and the
# transfers of a KV connector (--kv-transfer-config). This server is neither.
# Series only a server running LoRA adapters has (tests/integration/test_adapters.py serves one).
LORA_ONLY = re.compile(r"phasescope_adapter_")
DISAGGREGATION_ONLY = re.compile(r'\brole!?="|phasescope_kv_transfer_|phase="kv_transfer"|prompt_tokens_by_source')
# What the Prometheus Operator's service discovery adds to every series of a pod; the
# autoscalers' queries select on them.
NAMESPACE, POD = "phasescope-test", "phasescope-0"


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    instance = PrometheusServer(
        tmp_path_factory.mktemp("prometheus"),
        [f"127.0.0.1:{server.metrics_port}"],
        target_labels={"namespace": NAMESPACE, "pod": POD},
    )
    yield instance
    instance.stop()


@pytest.fixture(scope="module")
def loaded(prometheus: PrometheusServer, server: ServerProcess) -> str:
    """A short load with every outcome the dashboard shows: success, cancellation, rejection. Returns the instance."""
    instance = f"127.0.0.1:{server.metrics_port}"
    with server.client() as client:
        for index in range(4):
            client.generate(build_request(prompt=f"Load {index}:", max_tokens=12, ignore_eos=True))
        stream = client.generate_stream(build_request(prompt="Cancel:", max_tokens=400, ignore_eos=True))
        for index, _ in enumerate(stream):
            if index == 2:
                stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
                break
        with pytest.raises(grpc.RpcError):
            client.generate(build_request(prompt="bad", top_p=5.0))
        client.generate(build_request(prompt="And one more:", max_tokens=12, ignore_eos=True))

    # Enough scrapes after the load for rate() over the dashboard's window: rate() needs two samples of a series,
    # and the rejections' series, the last to appear, has them only two scrapes after the rejection.
    def scrapes(series: str) -> float:
        result = prometheus.query(f'count_over_time({series}{{instance="{instance}"}}[5m])')["data"]["result"]
        return min((float(each["value"][1]) for each in result), default=0.0)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if scrapes("phasescope_requests_in_flight") >= 5 and scrapes("phasescope_requests_rejected_total") >= 2:
            break
        time.sleep(0.5)
    return instance


def dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, instance: str) -> str:
    return (
        expr.replace("$model", "SmolLM2-135M-Instruct")
        # Grafana would escape the dots; an unescaped dot still matches itself.
        .replace("$instance", instance)
        .replace("$__rate_interval", "5m")
    )


def test_every_dashboard_query_evaluates_and_returns_data(prometheus: PrometheusServer, loaded: str) -> None:
    empty, failed = [], []
    for name, expr in dashboard_targets():
        # Over the load, as the panel draws it: a phase's operating point exists only while
        # that phase runs steps, so an instant query after the load would find it absent.
        answer = prometheus.query_range(substitute(expr, loaded), seconds=300)
        if answer["status"] != "success":
            failed.append(f"{name}: {answer.get('error')}")
        elif not answer["data"]["result"] and not any(
            only.search(expr) for only in (GPU_ONLY, SPECULATION_ONLY, DISAGGREGATION_ONLY, LORA_ONLY)
        ):
            empty.append(name)
    assert not failed
    assert not empty, f"panels without data: {empty}"


def test_template_variables_find_the_model_and_instance(prometheus: PrometheusServer, loaded: str) -> None:
    answer = prometheus.api("label/model/values", **{"match[]": "phasescope_requests_in_flight"})
    assert "SmolLM2-135M-Instruct" in answer["data"]
    answer = prometheus.api("label/instance/values", **{"match[]": "phasescope_requests_in_flight"})
    assert loaded in answer["data"]


def test_every_alert_expression_evaluates_and_the_rules_load(prometheus: PrometheusServer, loaded: str) -> None:
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    for rule in rules:
        answer = prometheus.query(rule["expr"])
        assert answer["status"] == "success", f"{rule['alert']}: {answer.get('error')}"
    # Prometheus loaded the same file and evaluates every rule without error.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        groups = prometheus.api("rules")["data"]["groups"]
        loaded_rules = [rule for group in groups for rule in group["rules"]]
        if len(loaded_rules) == len(rules) and all(
            rule.get("lastEvaluation", "").startswith("20") for rule in loaded_rules
        ):
            break
        time.sleep(0.5)
    assert {rule["name"] for rule in loaded_rules} == {rule["alert"] for rule in rules}
    assert all(rule["health"] == "ok" for rule in loaded_rules), [(r["name"], r.get("lastError")) for r in loaded_rules]


def test_keda_queries_return_one_value_for_the_deployment(prometheus: PrometheusServer, loaded: str) -> None:
    values: dict[str, list[float]] = {}
    for trigger in yaml.safe_load(SCALED_OBJECT.read_text())["spec"]["triggers"]:
        # Over the load: headroom is used only while requests run.
        answer = prometheus.query_range(trigger["metadata"]["query"], seconds=300)
        assert answer["status"] == "success", f"{trigger['name']}: {answer.get('error')}"
        series = answer["data"]["result"]
        # KEDA's Prometheus scaler refuses a query that returns more than one element.
        assert len(series) == 1, (trigger["name"], series)
        values[trigger["name"]] = [float(value) for _, value in series[0]["values"]]
        assert all(math.isfinite(value) and value >= 0 for value in values[trigger["name"]]), trigger["name"]
    # One pod: its 1 − headroom, at most 1, above 0 while the load ran.
    used = values["phasescope_headroom_used_ratio"]
    assert max(used) <= 1
    assert max(used) > 0


def test_prometheus_adapter_rules_find_the_pod_and_serve_its_metrics(prometheus: PrometheusServer, loaded: str) -> None:
    for rule in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]:
        name = rule["name"]["as"]
        # Discovery: the adapter lists the series its seriesQuery matches and maps their labels to resources.
        found = prometheus.api("series", **{"match[]": rule["seriesQuery"]})
        assert found["status"] == "success", f"{name}: {found.get('error')}"
        assert found["data"], f"{name}: seriesQuery found no series"
        assert {(series["namespace"], series["pod"]) for series in found["data"]} == {(NAMESPACE, POD)}
        (metric,) = {series["__name__"] for series in found["data"]}
        assert re.fullmatch(rule["name"]["matches"], metric), name
        # What the HPA's Pods metric asks for: this namespace's pods, one value per pod.
        query = render_adapter_query(
            rule["metricsQuery"],
            series=metric,
            label_matchers=f'namespace="{NAMESPACE}",pod=~"{POD}"',
            group_by="pod",
        )
        answer = prometheus.query(query)
        assert answer["status"] == "success", f"{name}: {query}: {answer.get('error')}"
        result = answer["data"]["result"]
        assert [series["metric"] for series in result] == [{"pod": POD}], f"{name}: {query}: {result}"
        assert math.isfinite(float(result[0]["value"][1])), name


def test_live_metrics_pass_promtool_lint(server: ServerProcess, client: Client) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run `make setup`"
    client.generate(build_request(prompt="lint", max_tokens=2))
    text = server.metrics_text()

    def lint(exposition: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True)

    ours = "\n".join(line for line in text.splitlines() if re.match(r"(# (HELP|TYPE) )?phasescope_", line)) + "\n"
    assert "phasescope_request_phase_seconds_bucket" in ours
    result = lint(ours)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (result.stdout + result.stderr).strip()
    # The whole exposition: promtool flags only vLLM's own reference series (names with
    # ':', a recording-rule convention, and a histogram named *_total): vLLM's naming.
    full = lint(text)
    problems = (full.stdout + full.stderr).strip().splitlines()
    unexpected = [line for line in problems if not line.startswith("vllm:")]
    assert not unexpected, unexpected
