"""The shipped Grafana dashboard and Prometheus alert rules, checked by a real Prometheus.

promtool checks the rules and runs their unit tests (series that fire each
alert and series that do not). The end-to-end test starts a real Prometheus
that scrapes a real `gb10d run` over gb10d.sim, drives a free-memory restart,
an Xid and a give-up with memory not given back, and asks Prometheus's HTTP
API for every dashboard query and for the alerts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from gb10d.base.errors import EXIT_MEMORY_NOT_RETURNED
from gb10d.daemon import lab
from harness import Daemon, NotifySocket, Setup, free_port, wait_until

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
DASHBOARD = MONITORING / "grafana" / "gb10d.json"
RULES = MONITORING / "prometheus" / "gb10d-alerts.yml"
RULE_TESTS = MONITORING / "prometheus" / "gb10d-alerts.test.yml"
XID_LINE = "[ 8123.456789] NVRM: Xid (PCI:0000:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x404600=0x80000004\n"


def tool(name: str) -> str:
    """The path of Debian's prometheus or promtool; a skip where it is missing, unless CI requires it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("GB10D_REQUIRE_PROMETHEUS"):
            pytest.fail(f"{name} is missing but GB10D_REQUIRE_PROMETHEUS is set (apt-get install prometheus)")
        pytest.skip(f"needs {name} (apt-get install prometheus; .ci/run installs it)")
    return path


def alert_names() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), re.MULTILINE)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, with Grafana's variables set as "All" sets them."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"].replace("$instance", ".+").replace("$__rate_interval", "1m"))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def test_the_alert_rules_pass_promtool_check() -> None:
    result = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in result.stdout


def test_every_alert_fires_on_its_series_and_stays_quiet_on_the_others() -> None:
    tests = RULE_TESTS.read_text()
    for name in alert_names():
        blocks = re.findall(rf"alertname: {name}\n\s+exp_alerts:(.*)", tests)
        assert "[]" in [b.strip() for b in blocks] and "" in [b.strip() for b in blocks], f"{name}: a firing and a quiet case"
        assert "runbook:" in RULES.read_text().split(f"alert: {name}\n", 1)[1].split("- alert:", 1)[0], f"{name} has a runbook"
    result = subprocess.run([tool("promtool"), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_uses_grafanas_current_schema_with_data_source_and_instance_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query" and variables["instance"]["includeAll"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]


class Prometheus:
    """A real Prometheus server scraping one gb10d every second and evaluating the shipped rules every second."""

    def __init__(self, root: Path, target: str) -> None:
        root.mkdir()
        # The rules as shipped, with every `for:` shortened: the test sees each alert reach firing in seconds.
        (root / "rules.yml").write_text(re.sub(r"^(\s+)for: \S+$", r"\1for: 2s", RULES.read_text(), flags=re.MULTILINE))
        (root / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}\n"
            "rule_files: [rules.yml]\n"
            f"scrape_configs: [{{job_name: gb10d, static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (root / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 60, "Prometheus ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"Prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params: str) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10, trust_env=False)
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]

    def empty(self, queries: list[tuple[str, str]]) -> list[str]:
        """The panels (and their query) for which Prometheus returns no series now."""
        return [f"{title}: {expr}" for title, expr in queries if not self.api("query", query=expr)["result"]]

    def fired(self) -> set[str]:
        """Every alert that has been firing in the last 10 minutes."""
        result = self.api("query", query='count by (alertname) (max_over_time(ALERTS{alertstate="firing"}[10m]))')["result"]
        return {series["metric"]["alertname"] for series in result}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Prometheus, int]]:
    port = free_port()
    server = Prometheus(tmp_path / "prometheus", f"127.0.0.1:{port}")
    yield server, port
    server.close()


@pytest.mark.slow
def test_prometheus_fills_every_dashboard_panel_and_fires_the_alerts_of_a_real_failure(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], prometheus: tuple[Prometheus, int]
) -> None:
    server, port = prometheus
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    (tmp_path / "ledger").mkdir()
    # 0.92 of 121.69 GiB does not fit in 103.45 GiB free: vLLM's own check fails and gb10d restarts it lower.
    setup = Setup(
        tmp_path, free_gib=103.45, utilization=0.92,
        extra={"memory.preflight": False, "memory.ledger_dir": str(tmp_path / "ledger"), "metrics.listen": f"127.0.0.1:{port}",
               "daemon.kernel_log": str(kernel_log)},
    )
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    daemon.wait_line(r"gb10d: free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92")
    # Tokens through vLLM: its stats lines and its own counters have something to say.
    completion = httpx.post(
        f"http://127.0.0.1:{setup.port}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 16},
        timeout=30, trust_env=False,
    )
    assert completion.status_code == 200, completion.text
    with kernel_log.open("a") as log:
        log.write(XID_LINE)
    daemon.wait_line(r"gb10d: NVIDIA Xid 13")
    queries = dashboard_queries()
    missing: list[str] = []

    def every_panel_has_data() -> bool:
        missing[:] = server.empty(queries)
        return not missing

    if lab.wait_until(every_panel_has_data, 90, step_s=0.5) is None:
        raise AssertionError("dashboard queries with no data:\n" + "\n".join(missing))
    assert daemon.stop() == 0

    # The same instance again, now failing in a way no restart can fix: 80 GiB stay trapped after vLLM dies.
    setup.scenario = "cuda_oom_during=profile,leak_gib=80"
    setup.extra["memory.recovery_timeout_s"] = 3.0
    setup.write_config()
    again = Daemon(setup, notify)
    daemons.append(again)
    assert again.wait_exit(120) == EXIT_MEMORY_NOT_RETURNED
    # Prometheus keeps every alert's state as the ALERTS series: one that fired and resolved still counts.
    expected = {"GB10dGaveUp", "GB10dTargetDown", "GB10dMemoryNotReturned", "GB10dDriverEvent", "GB10dNotReady"}
    fired: set[str] = set()

    def all_fired() -> bool:
        fired.update(server.fired())
        return expected <= fired

    if lab.wait_until(all_fired, 90, step_s=0.5) is None:
        raise AssertionError(f"fired: {sorted(fired)}; expected at least {sorted(expected)}")
