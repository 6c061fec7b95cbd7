"""A real Prometheus server (Debian's `prometheus` package) for tests, on a free port with a temporary TSDB."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from phasescope.bench.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str], target_labels: dict[str, str] | None = None) -> None:
        """`target_labels` go on every scraped series, as Kubernetes service discovery adds `namespace` and `pod`."""
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: run `make setup`"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "phasescope", "static_configs": [{"targets": targets, "labels": target_labels or {}}]}
            ],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self._log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {(workdir / 'prometheus.log').read_text()}"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                return
            time.sleep(0.1)
        raise TimeoutError("prometheus not ready after 60 s")

    def api(self, path: str, **params: str) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as error:
            # Prometheus answers bad queries with 400 and a JSON body saying why.
            return dict(json.loads(error.read()))

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def query_range(self, expr: str, seconds: float, step: float = 1.0) -> dict[str, Any]:
        """`expr` over the last `seconds`, as a dashboard's time series panel asks for it."""
        end = time.time()
        return self.api("query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step=f"{step:g}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def render_adapter_query(template: str, series: str, label_matchers: str, group_by: str) -> str:
    """A prometheus-adapter `metricsQuery` as the adapter sends it, its `<<.Field>>` placeholders filled in.

    For a Pods metric the adapter passes the series' name, `namespace="ns",pod=~"a|b"` as the label
    matchers and `pod` as the grouping.
    """
    values = {"Series": series, "LabelMatchers": label_matchers, "GroupBy": group_by}

    def fill(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"prometheus-adapter has no placeholder <<.{match.group(1)}>>"
        return values[match.group(1)]

    return re.sub(r"<<\s*\.(\w+)\s*>>", fill, template)
