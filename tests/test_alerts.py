"""Alert rules as code (deploy/prometheus): promtool checks the rules and the Prometheus config
the compose `observability` profile mounts, runs the rules' unit tests (alerts_test.yml), and
these tests hold the conventions promtool cannot: every alert carries a severity and the
summary/description/runbook annotations, every alert is tested firing and quiet, the scrape jobs
the rules name exist, and docs/operations.md lists every alert.

promtool comes from Debian's `prometheus` package (scripts/setup.sh installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
# where the compose service writes $ADMIN_TOKEN before starting Prometheus (compose.yaml)
TOKEN_FILE = "/run/llm-stream/admin_token"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (Debian package `prometheus`: scripts/setup.sh)")
SEVERITIES = {"critical", "warning"}


def promtool(*args: str, cwd: Path = PROM_DIR, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@needs_promtool
def test_alert_rules_pass_promtool_check():
    proc = promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


@needs_promtool
def test_alert_rules_unit_tests_pass():
    proc = promtool("test", "rules", str(ALERTS_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_prometheus_config_passes_promtool_check(tmp_path):
    """The very file compose mounts, with the token path moved to a file that exists here
    (promtool checks that credentials files exist)."""
    token = tmp_path / "admin_token"
    token.write_text("")
    text = PROM_CONFIG.read_text()
    (tmp_path / "prometheus.yml").write_text(text.replace(TOKEN_FILE, str(token)))
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    proc = promtool("check", "config", str(tmp_path / "prometheus.yml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout, "rule_files must load alerts.yml"


def test_prometheus_config_discovers_every_replica_with_the_admin_token():
    config = yaml.safe_load(PROM_CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name, services, port in (("gateway", ["gateway"], 8000), ("worker", ["worker", "worker-gpu"], 9400)):
        job = jobs[name]
        # DNS discovery of the compose service: one A record per replica, so scaling needs no edit
        [dns] = job["dns_sd_configs"]
        assert dns["names"] == services and dns["type"] == "A" and dns["port"] == port
        assert job["authorization"] == {"type": "Bearer", "credentials_file": TOKEN_FILE}
    assert jobs["redis"]["static_configs"][0]["targets"] == ["redis-exporter:9121"]


def test_every_alert_has_a_severity_and_summary_description_runbook():
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"LLM[A-Z][A-Za-z0-9]+", name), f"{name}: alert names are LLM + CamelCase"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity must be one of {SEVERITIES}"
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert str(annotations.get(key, "")).strip(), f"{name} lacks a {key} annotation"
        assert len(annotations["summary"]) <= 80, f"{name}: the summary is a one-line title"


def test_every_alert_is_unit_tested_firing_and_quiet():
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
            for alert in case.get("exp_alerts") or []:
                # promtool compares annotations exactly: a firing case pins the rendered text
                assert set(alert.get("exp_annotations", {})) >= {"summary", "description", "runbook"}
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), f"alerts never tested firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never tested quiet: {sorted(names - quiet)}"
    assert (fires | quiet) - names == set(), f"tests of unknown alerts: {sorted((fires | quiet) - names)}"


def test_alerts_name_only_scrape_jobs_the_config_defines():
    jobs = {job["job_name"] for job in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]}
    for rule in alert_rules():
        for op, value in re.findall(r'\bjob\s*(=~|=)\s*"([^"]*)"', rule["expr"]):
            named = value.split("|") if op == "=~" else [value]
            assert set(named) <= jobs, f"{rule['alert']} names job(s) {named}, scrape jobs are {sorted(jobs)}"


def test_operations_doc_lists_every_alert():
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert "deploy/prometheus/alerts.yml" in doc
    listed = set(re.findall(r"^\| `(LLM[A-Za-z0-9]+)` \|", doc, flags=re.M))
    names = {rule["alert"] for rule in alert_rules()}
    assert names - listed == set(), f"docs/operations.md lacks alerts {sorted(names - listed)}"
    assert listed - names == set(), f"docs/operations.md lists alerts that do not exist: {sorted(listed - names)}"
