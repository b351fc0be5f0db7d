"""deploy/prometheus and deploy/grafana: promtool checks and rule unit tests, and every metric, label and
label value that a rule or a dashboard query names exists in the daemon's registry (sidecar.ops.metrics)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser as pp
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from sidecar.ops import metrics as daemon_metrics

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"
RULES = PROM / "kv-sidecar-rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kv-sidecar.json"
RULE_TESTS = Path(__file__).with_name("kv_sidecar_rules_test.yml")
# Series Prometheus makes itself, and labels it attaches to every target (scrape configs in deploy/).
BUILTIN_SERIES = {"up"}
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "node", "cluster"}
# Labels whose values are a closed set in the daemon.
CLOSED_VALUES = {
    ("kv_sidecar_requests_total", "outcome"): set(daemon_metrics.OUTCOMES),
    ("kv_sidecar_handshakes_total", "outcome"): set(daemon_metrics.HANDSHAKE_OUTCOMES),
    ("kv_sidecar_stage_seconds_bucket", "stage"): set(daemon_metrics.STAGES),
    ("kv_sidecar_stage_seconds_sum", "stage"): set(daemon_metrics.STAGES),
    ("kv_sidecar_stage_seconds_count", "stage"): set(daemon_metrics.STAGES),
    ("kv_sidecar_fp8_reencoded_elements_total", "kind"): set(daemon_metrics.FP8_REENCODE_KINDS),
    ("kv_sidecar_read_modes_total", "mode"): set(daemon_metrics.READ_MODES),
    ("kv_sidecar_peer_mappings_total", "outcome"): set(daemon_metrics.MAPPING_OUTCOMES),
}


# ------------------------------------------------------------------------------------ the daemon's registry


def registry_series() -> dict[str, set[str]]:
    """{series name: label names} as the daemon exposes them, every labelled metric given one child."""
    m = daemon_metrics.Metrics()
    for obj in vars(m).values():
        if isinstance(obj, MetricWrapperBase) and obj._labelnames:
            obj.labels(*["probe"] * len(obj._labelnames))
    series: dict[str, set[str]] = {}
    for family in m.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


# --------------------------------------------------------------------------------------------- PromQL reading


GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's $variables so the query parses: durations by a duration, others by a regex."""

    def sub(m: re.Match) -> str:
        return GRAFANA_VARS.get(m.group(1) or m.group(2), ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)


class Use:
    """What one PromQL expression reads: selectors (name, matchers) and grouping label names."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.selectors: list[tuple[str, list[tuple[str, str, str]]]] = []
        self.groupings: set[str] = set()
        pp.walk(pp.parse(expr), self._visit)

    def _visit(self, node) -> None:
        if isinstance(node, pp.VectorSelector):
            matchers = [(m.name, str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers]
            name = node.name or next((v for n, op, v in matchers if n == "__name__" and op == "Equal"), None)
            assert name, f"selector without a metric name in {self.expr!r}"
            self.selectors.append((name, [m for m in matchers if m[0] != "__name__"]))
        elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            self.groupings.update(node.modifier.labels)
        elif (
            isinstance(node, pp.BinaryExpr)
            and node.modifier is not None
            and node.modifier.matching is not None
        ):
            self.groupings.update(node.modifier.matching.labels)


def _literal_alternatives(value: str, op: str) -> list[str]:
    """The literal values a matcher names: 'a|b' for regexes made only of alternatives, else the value."""
    if op in ("Re", "NotRe"):
        if not re.fullmatch(r"[\w|]+", value):
            return []
        return value.split("|")
    return [value]


def check_uses(uses: list[Use], series: dict[str, set[str]]) -> list[str]:
    problems = []
    for use in uses:
        labels_in_scope = set(TARGET_LABELS)
        for name, matchers in use.selectors:
            if name in BUILTIN_SERIES:
                continue
            if name not in series:
                problems.append(f"{name}: not in the daemon's registry ({use.expr!r})")
                continue
            labels = series[name] | TARGET_LABELS
            labels_in_scope |= series[name]
            for label, op, value in matchers:
                if label not in labels:
                    problems.append(f"{name}: no label {label!r} ({use.expr!r})")
                allowed = CLOSED_VALUES.get((name, label))
                if allowed is not None:
                    for v in _literal_alternatives(value, op):
                        if v not in allowed:
                            problems.append(f"{name}{{{label}}}: value {v!r} not in {sorted(allowed)}")
        for label in use.groupings - labels_in_scope - {"le"}:
            problems.append(f"grouping by {label!r}, which no selected series has ({use.expr!r})")
    return problems


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    d = dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, f"unsupported variable query {var['definition']!r}"
            exprs.append(f"count by ({m.group(2)}) ({m.group(1)})")
    return [grafana_to_promql(e) for e in exprs]


# ------------------------------------------------------------------------------------------------ the checks


def test_registry_has_the_fixed_names():
    """The names of the team map, as Prometheus sees them (counters get _total, histograms _bucket...)."""
    series = registry_series()
    for name in (
        "kv_sidecar_requests_total",
        "kv_sidecar_bytes_pulled_total",
        "kv_sidecar_gap_bytes_read_total",
        "kv_sidecar_gap_span_waits_total",
        "kv_sidecar_stage_seconds_bucket",
        "kv_sidecar_requests_in_flight",
        "kv_sidecar_staging_waiting",
        "kv_sidecar_staging_slots_kept_out",
        "kv_sidecar_refusals_total",
        "kv_sidecar_heartbeats_sent_total",
        "kv_sidecar_registered_bytes",
        "kv_sidecar_handshakes_total",
        "kv_sidecar_invalid_messages_total",
        "kv_sidecar_ready",
        "kv_sidecar_build_info",
    ):
        assert name in series, name


def test_every_rule_metric_exists_in_the_daemon_registry():
    problems = check_uses([Use(e) for e in rule_exprs()], registry_series())
    assert not problems, "\n".join(problems)


def test_every_dashboard_metric_exists_in_the_daemon_registry():
    problems = check_uses([Use(e) for e in dashboard_exprs()], registry_series())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "expr, needle",
    [
        ("rate(kv_sidecar_request_total[5m])", "kv_sidecar_request_total: not in"),
        ("sum by (stage) (rate(kv_sidecar_requests_total[5m]))", "grouping by 'stage'"),
        ('kv_sidecar_stage_seconds_bucket{stage="e2e"}', "value 'e2e'"),
        ('kv_sidecar_requests_total{outcome=~"failed|timeout"}', "value 'timeout'"),
        ('kv_sidecar_ready{reason="x"}', "no label 'reason'"),
    ],
)
def test_the_name_check_catches_mistakes(expr, needle):
    problems = check_uses([Use(expr)], registry_series())
    assert any(needle in p for p in problems), problems


def test_grafana_variables_are_replaced_before_parsing():
    expr = grafana_to_promql(
        'sum(rate(kv_sidecar_bytes_pulled_total{instance=~"$instance"}[$__rate_interval]))'
    )
    assert expr == 'sum(rate(kv_sidecar_bytes_pulled_total{instance=~".*"}[5m]))'
    assert Use(expr).selectors == [("kv_sidecar_bytes_pulled_total", [("instance", "Re", ".*")])]


def test_rules_cover_the_four_alerts_the_issue_names():
    names = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {
        "KvSidecarDown",
        "KvSidecarHighFailureRatio",
        "KvSidecarEndToEndLatencyP99High",
        "KvSidecarRefusing",
    } <= names
    for g in yaml.safe_load(RULES.read_text())["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] == "kv-sidecar" and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        own = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not own & cells, f"panel {p['title']!r} overlaps another"
        cells |= own
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "instance"} <= names


def test_dashboard_shows_what_the_issue_asks():
    """Throughput, per-stage latency percentiles, failures and refusals by reason, requests in flight."""
    uses = [Use(e) for e in dashboard_exprs()]
    read = {name for u in uses for name, _ in u.selectors}
    assert {
        "kv_sidecar_requests_total",
        "kv_sidecar_bytes_pulled_total",
        "kv_sidecar_gap_bytes_read_total",
        "kv_sidecar_requests_in_flight",
        "kv_sidecar_refusals_total",
        "kv_sidecar_stage_seconds_bucket",
        "kv_sidecar_staging_slots_kept_out",
    } <= read
    quantiles = {
        float(m)
        for e in dashboard_exprs()
        for m in re.findall(r"histogram_quantile\(([0-9.]+),", e)
        if "by (stage, le)" in e
    }
    assert quantiles >= {0.5, 0.9, 0.99}
    assert any("by (field)" in e and "kv_sidecar_refusals_total" in e for e in dashboard_exprs())
    assert any("by (outcome)" in e and 'outcome!="ok"' in e for e in dashboard_exprs())


def test_kubernetes_scrape_job_keeps_the_sidecar_ports():
    (job,) = yaml.safe_load((PROM / "scrape-kubernetes.yml").read_text())["scrape_configs"]
    assert job["job_name"].startswith("kv-sidecar")
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keeps = {
        tuple(r["source_labels"]): re.compile(r["regex"])
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    port_re = keeps[("__meta_kubernetes_pod_container_port_name",)]
    assert port_re.fullmatch("kv-metrics-gpu0") and port_re.fullmatch("kv-metrics-gpu1")
    assert not port_re.fullmatch("http")
    assert keeps[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)].fullmatch("true")


# ------------------------------------------------------------------------------------------------ promtool


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: apt-get install -y --no-install-recommends prometheus")
        pytest.skip("promtool not installed (apt-get install -y --no-install-recommends prometheus)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120)


def test_promtool_check_rules():
    r = _run("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_config():
    r = _run("check", "config", str(PROM / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests():
    """Each alert fires on a synthetic bad series and stays quiet on a healthy one (tests/deploy/*.yml)."""
    r = _run("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr
