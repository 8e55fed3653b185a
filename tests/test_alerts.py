"""Alert rules as code (deploy/prometheus): promtool checks the rules and the Prometheus config
the compose `observability` profile mounts, runs the rules' unit tests (alerts_test.yml), and
these tests hold the conventions promtool cannot: every alert carries a severity and the
summary/description/runbook annotations, every alert is tested firing and quiet, the scrape jobs
the rules name exist, and docs/operations.md lists every alert. Last, the real Prometheus runs
this config against a real gateway that has an ADMIN_TOKEN.

promtool and prometheus come from Debian's `prometheus` package (scripts/setup.sh installs it)."""

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


def exported_bucket_edges() -> dict[str, set[str]]:
    """`<histogram>_bucket` -> the `le` values the gateway's and the worker's registries export."""
    from gateway.metrics import GatewayMetrics
    from worker.metrics import WorkerMetrics
    edges: dict[str, set[str]] = {}
    for registry in (GatewayMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    edges.setdefault(sample.name, set()).add(sample.labels["le"])
    return edges


def bucket_series(group: dict) -> dict[str, set[str]]:
    """`<histogram>_bucket` -> the `le` values one promtool test group feeds."""
    out: dict[str, set[str]] = {}
    for series in group.get("input_series", []):
        m = re.fullmatch(r"(\w+_bucket)\{(.*)\}", series["series"])
        if m:
            out.setdefault(m.group(1), set()).add(re.search(r'le="([^"]+)"', m.group(2)).group(1))
    return out


def same_edge(a: str, b: str) -> bool:
    return a == b or (a != "+Inf" and b != "+Inf" and float(a) == float(b))


def test_histogram_cases_use_edges_the_code_exports():
    """A quantile in a promtool case is only what production reads if the case's buckets are
    the code's (shared/slo_buckets.py): an edge the code lacks would test another layout."""
    exported = exported_bucket_edges()
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    checked = 0
    for group in tests["tests"]:
        for name, edges in bucket_series(group).items():
            assert name in exported, f"{group['name']}: {name} is not exported"
            stray = [le for le in edges if not any(same_edge(le, e) for e in exported[name])]
            assert not stray, f"{group['name']}: {name} has no bucket le={stray} (the code's: {sorted(exported[name])})"
            checked += 1
    assert checked >= 10


def test_ttft_slo_cases_use_the_whole_exported_layout():
    """The healthy and the sick SLO cases feed every edge of gateway_ttft_seconds, so their
    p95 is exactly what Prometheus reads from a real gateway; there is an edge at the SLO."""
    from shared.slo_buckets import TTFT_BUCKETS
    exported = exported_bucket_edges()["gateway_ttft_seconds_bucket"]
    assert 2.0 in TTFT_BUCKETS and 0.5 in TTFT_BUCKETS   # the SLO's and the drift/jump alerts' thresholds
    groups = {g["name"]: g for g in yaml.safe_load(ALERTS_TEST.read_text())["tests"]}
    healthy = groups["TTFT p95 of a healthy load (every TTFT <= 1.3 s) stays under the SLO"]
    sick = groups["TTFT p95 breaks the SLO"]
    for group in (healthy, sick):
        fed = bucket_series(group)["gateway_ttft_seconds_bucket"]
        assert {float(le) for le in fed} == {float(le) for le in exported}
    assert [c["exp_alerts"] for c in healthy["alert_rule_test"]] == [[]]
    assert sick["alert_rule_test"][-1]["exp_alerts"], "the sick load must fire"


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


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package `prometheus`: scripts/setup.sh)")
async def test_prometheus_with_this_config_scrapes_a_gateway_with_the_admin_token(redis_server, stream_prefix,
                                                                                   tmp_path):
    """The real Prometheus binary on prometheus.yml, its jobs pointed at a real gateway that has an
    ADMIN_TOKEN (static targets stand in for compose's DNS names): the `gateway` job, reading the
    token file, scrapes it; the `worker` job, given a wrong token, is refused 401; the rules load."""
    import asyncio
    import os

    import httpx

    from shared.localredis import free_port
    from tests.stack_fixtures import gateway_in_process, gateway_settings

    async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix, admin_token="s3cret")) as gw:
        (tmp_path / "token").write_text("s3cret\n")
        (tmp_path / "wrong-token").write_text("nope")
        config = yaml.safe_load(PROM_CONFIG.read_text())
        config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        for job in config["scrape_configs"]:
            if job["job_name"] in ("gateway", "worker"):
                job.pop("dns_sd_configs")
                job["static_configs"] = [{"targets": [f"127.0.0.1:{gw.port}"]}]
                job["authorization"]["credentials_file"] = str(tmp_path / ("token" if job["job_name"] == "gateway"
                                                                           else "wrong-token"))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(ALERTS, tmp_path / "alerts.yml")
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                targets: dict[str, dict] = {}
                for _ in range(300):
                    assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                    try:
                        active = (await client.get(f"{api}/targets")).json()["data"]["activeTargets"]
                        targets = {t["labels"]["job"]: t for t in active}
                    except (httpx.HTTPError, ValueError, KeyError):
                        targets = {}
                    if all(targets.get(job, {}).get("health") in ("up", "down") for job in ("gateway", "worker")):
                        break
                    await asyncio.sleep(0.1)
                assert targets["gateway"]["health"] == "up", targets["gateway"]
                assert targets["worker"]["health"] == "down" and "401" in targets["worker"]["lastError"]
                result = (await client.get(f"{api}/query", params={"query": 'up{job="gateway"}'})).json()
                assert [r["value"][1] for r in result["data"]["result"]] == ["1"]
                groups = (await client.get(f"{api}/rules", params={"type": "alert"})).json()["data"]["groups"]
                assert sum(len(g["rules"]) for g in groups) == len(alert_rules())
                assert all(r["health"] != "err" for g in groups for r in g["rules"])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                proc.wait(timeout=30)
            log.close()
