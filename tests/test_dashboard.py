"""The Grafana dashboard (deploy/grafana) and the alert rules (deploy/prometheus/alerts.yml) query
only metrics the code exports, with labels those metrics have.

The exported names come from the code itself: `gateway.metrics.GatewayMetrics().registry` and
`worker.metrics.WorkerMetrics().registry` (each family's type gives the suffixes Prometheus sees:
`_total` for counters, `_bucket`/`_sum`/`_count` for histograms), plus an explicit allow-list of
what others export: redis_exporter (the compose `observability` profile) and Prometheus itself.
A small PromQL tokenizer pulls metric names, label matchers and grouping labels out of every
expression; `promtool check rules` then parses every dashboard query as real PromQL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")

# Labels Prometheus attaches to every scraped series (job/instance) and our relabelling adds
# (deploy/prometheus/prometheus.yml: `service` = the compose service a replica belongs to).
TARGET_LABELS = {"job", "instance", "service"}

# Metrics from outside this code base, with their labels (besides TARGET_LABELS).
# redis_exporter v1.67 (oliver006/redis_exporter, exporter/exporter.go and streams.go): INFO fields
# under the `redis_` namespace; stream metrics for REDIS_EXPORTER_CHECK_SINGLE_STREAMS (compose.yaml).
REDIS_EXPORTER = {
    "redis_up": set(),
    "redis_memory_used_bytes": set(),
    "redis_memory_max_bytes": set(),
    "redis_aof_last_write_status": set(),
    "redis_commands_processed_total": set(),
    "redis_connected_clients": set(),
    "redis_stream_length": {"db", "stream"},
    "redis_stream_group_lag": {"db", "stream", "group"},
    "redis_stream_group_messages_pending": {"db", "stream", "group"},
}
# Prometheus's own series: `up` per target, ALERTS per pending/firing alert (any alert label).
PROMETHEUS = {"up": set(), "ALERTS": None}
# prometheus-client's process collector (a worker registers it; names from the client's docs).
PROCESS = {name: set() for name in (
    "process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
    "process_start_time_seconds", "process_open_fds", "process_max_fds")}

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                "topk", "quantile", "limitk", "limit_ratio"}
FUNCTIONS = AGGREGATIONS | {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort",
    "sort_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time", "acos", "acosh", "asin", "asinh", "atan",
    "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh", "deg", "rad", "pi"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}

TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*)
  | (?P<op>=~|!~|!=|==|>=|<=|\S)
""", re.X)


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as PromQL would see them after interpolation."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_:]*\}?", ".*", expr)


def parse(expr: str) -> tuple[list[tuple[str, set[str]]], set[str], set[str]]:
    """(selectors as (metric, matcher labels), grouping labels, functions) of one PromQL expression."""
    tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(expr)]
    selectors: list[tuple[str, set[str]]] = []
    grouping: set[str] = set()
    functions: set[str] = set()
    i = 0

    def matchers(j: int) -> tuple[set[str], int]:
        """Label names of `{a="x", b=~"y"}` starting at tokens[j] == '{'; returns the index after '}'."""
        labels: set[str] = set()
        j += 1
        while tokens[j][1] != "}":
            kind, text = tokens[j]
            if kind == "ident" and tokens[j + 1][1] in ("=", "!=", "=~", "!~"):
                labels.add(text)
                assert tokens[j + 2][0] == "string", f"label {text}: a matcher needs a quoted value in {expr!r}"
                j += 3
            elif text == ",":
                j += 1
            else:
                raise AssertionError(f"unexpected {text!r} in a label matcher of {expr!r}")
        return labels, j + 1

    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind != "ident":
            assert text != "{", f"a selector without a metric name in {expr!r}: name the metric"
            i += 1
        elif text in GROUPING:
            if following == "(":
                j = i + 2
                while tokens[j][1] != ")":
                    if tokens[j][0] == "ident":
                        grouping.add(tokens[j][1])
                    j += 1
                i = j + 1
            else:
                i += 1
        elif text in KEYWORDS:
            i += 1
        elif following == "(" or (text in AGGREGATIONS and following in ("by", "without")):
            functions.add(text)
            i += 1
        else:
            labels: set[str] = set()
            i += 1
            if following == "{":
                labels, i = matchers(i)
            selectors.append((text, labels))
    return selectors, grouping, functions


def registry_metrics(registry) -> dict[str, set[str]]:
    """Every series name a prometheus-client registry exposes, with its label names. A labelled
    family with no child yet has no samples, so names come from the family's type."""
    suffixes = {"counter": ["_total", "_created"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count", "_created"],
                "summary": ["", "_sum", "_count", "_created"], "info": ["_info"], "stateset": [""], "unknown": [""],
                "gaugehistogram": ["_bucket", "_gsum", "_gcount"]}
    labelnames: dict[str, set[str]] = {}
    # prometheus-client keeps no public map from a family to its label names: read them off the
    # collectors (Counter/Gauge/Histogram keep `_labelnames`)
    for collector, names in getattr(registry, "_collector_to_names", {}).items():
        for name in names:
            labelnames.setdefault(name, set()).update(getattr(collector, "_labelnames", ()) or ())
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        base = set(labelnames.get(family.name, set()))
        for suffix in suffixes[family.type]:
            name = family.name + suffix
            out[name] = base | labelnames.get(name, set()) | ({"le"} if suffix == "_bucket" else set()) \
                | ({"quantile"} if family.type == "summary" and not suffix else set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def exported_metrics() -> dict[str, set[str] | None]:
    """Metric name -> its label names (None: any label)."""
    from gateway.metrics import GatewayMetrics
    try:
        from worker.metrics import WorkerMetrics
    except ModuleNotFoundError as exc:  # pragma: no cover - the lead's worker /metrics change
        pytest.fail(f"worker/metrics.py with WorkerMetrics (the worker's /metrics) is required: {exc}")
    names: dict[str, set[str] | None] = {}
    names.update(registry_metrics(GatewayMetrics().registry))
    names.update(registry_metrics(WorkerMetrics().registry))
    for external in (REDIS_EXPORTER, PROMETHEUS, PROCESS):
        names.update(external)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) of every query in every dashboard: panel targets and template variables."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        panels = [p for p in board["panels"]] + [c for p in board["panels"] for c in p.get("panels", [])]
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']!r} {target['refId']}", target["expr"]))
        for var in board.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)", query.strip())
                assert m, f"{path.name}: variable {var['name']}: use label_values(metric, label)"
                # `by (label)` makes the variable's label a checked grouping label of the metric
                out.append((f"{path.name}: variable ${var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


def alert_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(f"alerts.yml: {r.get('alert') or r.get('record')}", r["expr"]) for g in groups for r in g["rules"]]


def check_expression(where: str, expr: str, exported: dict[str, set[str] | None]) -> list[str]:
    problems = []
    selectors, grouping, functions = parse(grafana_to_promql(expr))
    if not selectors:
        problems.append(f"{where}: no metric in {expr!r}")
    unknown_functions = functions - FUNCTIONS
    if unknown_functions:
        problems.append(f"{where}: unknown PromQL function(s) {sorted(unknown_functions)}")
    labels_here: set[str] = set(TARGET_LABELS)
    for metric, labels in selectors:
        if metric not in exported:
            problems.append(f"{where}: `{metric}` is not exported (gateway/worker registries, redis_exporter, "
                            f"Prometheus)")
            continue
        known = exported[metric]
        if known is None:
            labels_here.add("*")
            continue
        labels_here |= known
        stray = labels - known - TARGET_LABELS - {"__name__"}
        if stray:
            problems.append(f"{where}: `{metric}` has no label(s) {sorted(stray)} (it has {sorted(known)})")
    if "*" not in labels_here:
        stray = grouping - labels_here
        if stray:
            problems.append(f"{where}: groups by {sorted(stray)}, which no metric of the expression has")
    return problems


def test_tokenizer_finds_metrics_labels_and_functions():
    selectors, grouping, functions = parse(grafana_to_promql(
        'histogram_quantile(0.95, sum by (le, kind) (rate(worker_step_duration_seconds_bucket{instance=~"$worker"}'
        '[$__rate_interval]))) > 2 * (sum(rate(gateway_flushes_total[1h] offset 1d)) or vector(0)) '
        'and on() max(gateway_queue_depth{state="queued", job!="x"}) > 10 unless up == 0'))
    assert selectors == [("worker_step_duration_seconds_bucket", {"instance"}), ("gateway_flushes_total", set()),
                         ("gateway_queue_depth", {"state", "job"}), ("up", set())]
    assert grouping == {"le", "kind"}
    assert functions == {"histogram_quantile", "sum", "rate", "vector", "max"}
    assert parse("deriv(max(gateway_queue_depth)[10m:])")[0] == [("gateway_queue_depth", set())]


def test_registry_names_include_type_suffixes_and_labels():
    from gateway.metrics import GatewayMetrics
    names = registry_metrics(GatewayMetrics().registry)
    assert names["gateway_requests_total"] == {"outcome"}
    assert names["gateway_ttft_seconds_bucket"] == {"le"}
    assert "gateway_ttft_seconds_count" in names and "gateway_active_sockets" in names
    assert "gateway_requests" not in names, "counters are exposed with _total"


def test_checker_rejects_unknown_metrics_labels_and_functions():
    exported = {"gateway_requests_total": {"outcome"}, "up": set()}
    assert check_expression("x", 'sum by (outcome) (rate(gateway_requests_total{outcome="error"}[5m]))', exported) == []
    assert check_expression("x", "rate(gateway_requests[5m])", exported)                  # no _total
    assert check_expression("x", 'gateway_requests_total{code="x"}', exported)             # no such label
    assert check_expression("x", "sum by (code) (gateway_requests_total)", exported)       # nor grouping label
    assert check_expression("x", "rat(gateway_requests_total[5m])", exported)              # typo'd function


def test_dashboard_queries_use_only_exported_metrics_and_labels():
    exported = exported_metrics()
    queries = dashboard_queries()
    assert len(queries) > 50
    problems = [p for where, expr in queries for p in check_expression(where, expr, exported)]
    assert not problems, "\n".join(problems)


def test_alert_rules_use_only_exported_metrics_and_labels():
    exported = exported_metrics()
    problems = [p for where, expr in alert_queries() for p in check_expression(where, expr, exported)]
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`: scripts/setup.sh)")
def test_dashboard_queries_are_valid_promql(tmp_path):
    """Every dashboard query, Grafana variables interpolated, parsed by promtool as a recording rule."""
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_queries())]
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "dashboard_rules.yml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- dashboard structure and provisioning

def test_dashboard_layout_is_sound_and_covers_every_area():
    [path] = DASHBOARDS
    board = json.loads(path.read_text())
    assert board["uid"] == "llm-stream" and board["title"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, f"{p['title']}: outside the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    for area in ("Traffic & latency", "Engine", "KV cache & prefix cache", "Cancellation", "Failover & I/O",
                 "Gateway edge", "Redis"):
        assert area in rows, f"the dashboard lacks a {area!r} row"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p.get("description"), f"{p['title']!r}: say what the panel shows and what good looks like"
        assert p["datasource"]["uid"] == "prometheus"
        assert p["targets"] and all(t["expr"].strip() and t["datasource"]["uid"] == "prometheus" for t in p["targets"])
    # latency panels show the tail, not just a median
    titles = {p["title"]: p for p in panels}
    ttft = [t["expr"] for t in titles["Time to first token (gateway)"]["targets"]]
    assert [e.split(",")[0] for e in ttft] == ["histogram_quantile(0.5", "histogram_quantile(0.95",
                                               "histogram_quantile(0.99"]
    assert all("sum by (le)" in e for e in ttft), "quantiles aggregate buckets over every replica"


def test_grafana_provisioning_points_at_the_profiles_prometheus_and_dashboards():
    [datasource] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["uid"] == "prometheus" and datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "llm-stream.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"


# ---------------------------------------------------------------- present from the start

SELECTOR = re.compile(r"\b((?:gateway|worker)_[a-z0-9_]+)(?:\{([^}]*)\})?")


def series_used() -> dict[str, set[tuple[str, str]]]:
    """gateway_/worker_ metric -> the (label, value) equality matchers the dashboard and the
    alerts put on it (regex matchers and the target labels aside)."""
    used: dict[str, set[tuple[str, str]]] = {}
    for _, expr in dashboard_queries() + alert_queries():
        for name, matchers in SELECTOR.findall(grafana_to_promql(expr)):
            pairs = used.setdefault(name, set())
            for label, value in re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers or ""):
                if label not in TARGET_LABELS:
                    pairs.add((label, value))
    return used


async def test_every_series_the_dashboard_and_alerts_use_is_scraped_from_a_fresh_start(redis_server, stream_prefix,
                                                                                        tmp_path):
    """A gateway and a worker that have served nothing yet already export every metric the
    dashboard and the alert rules query, and every labelled series they select (e.g.
    gateway_rejections_total{code="overloaded"}) at 0: `rate()` then counts the first event
    after a start, and no panel shows "no data"."""
    import httpx

    from shared.localredis import free_port
    from tests.stack_fixtures import gateway_in_process, gateway_settings, metric_samples, start_synthetic_worker

    port = free_port()
    worker = start_synthetic_worker(redis_server.url, stream_prefix, tmp_path, name="w-fresh",
                                    env={"WORKER_METRICS_PORT": port})
    try:
        async with gateway_in_process(gateway_settings(redis_server.url, stream_prefix)) as gw, \
                httpx.AsyncClient(timeout=10) as http:
            scraped = {**metric_samples((await http.get(gw.base + "/metrics")).text),
                       **metric_samples((await http.get(f"http://127.0.0.1:{port}/metrics")).text)}
    finally:
        worker.stop()
    labels_of: dict[str, list[dict]] = {}
    for name, labels in scraped:
        labels_of.setdefault(name, []).append(dict(labels))
    assert scraped[("worker_max_batch", ())] == 8          # start_synthetic_worker's --max-batch
    used = series_used()
    assert {"gateway_rejections_total", "gateway_resumes_total", "gateway_cancel_latency_seconds_bucket",
            "worker_num_requests_waiting", "worker_max_batch"} <= set(used)
    missing = []
    for name, pairs in sorted(used.items()):
        if name not in labels_of:
            missing.append(name)
            continue
        for label, value in sorted(pairs):
            if not any(s.get(label) == value for s in labels_of[name]):
                missing.append(f'{name}{{{label}="{value}"}}')
    assert not missing, f"not exported before the first event: {missing}"
    for name, pairs in used.items():      # and at zero: nothing happened yet
        if name.endswith("_total"):
            assert all(v == 0 for (n, _), v in scraped.items() if n == name), name
