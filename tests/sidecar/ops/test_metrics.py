"""Metric names and the HTTP endpoint (a real server on a free loopback port)."""

import urllib.error
import urllib.request

import pytest

from sidecar import __version__
from sidecar.ops.metrics import OUTCOMES, STAGES, Health, Metrics, start_http_server

NAMES = ["kv_sidecar_requests_total", "kv_sidecar_bytes_pulled_total", "kv_sidecar_stage_seconds_bucket",
         "kv_sidecar_requests_in_flight", "kv_sidecar_refusals_total", "kv_sidecar_heartbeats_sent_total",
         "kv_sidecar_registered_bytes", "kv_sidecar_handshakes_total", "kv_sidecar_invalid_messages_total",
         "kv_sidecar_ready", "kv_sidecar_build_info"]


def value(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, v = line.rpartition(" ")
        if key == name:
            return float(v)
    raise AssertionError(f"{name} not in exposition")


def test_names_and_helpers():
    m = Metrics()
    m.answered("ok", {"queue": 0.001, "transfer": 0.02, "end_to_end": 0.03, "mystery": 1.0})
    m.answered("expired")
    m.refused("block_size")
    m.handshake("ok")
    m.handshake("failed")
    m.bytes_pulled.inc(4096)
    text = m.expose().decode()
    for name in NAMES:
        assert name in text, name
    for outcome in OUTCOMES:  # every series exists from the start
        assert f'kv_sidecar_requests_total{{outcome="{outcome}"}}' in text
    for stage in STAGES:
        assert f'kv_sidecar_stage_seconds_count{{stage="{stage}"}}' in text
    assert value(text, 'kv_sidecar_requests_total{outcome="ok"}') == 1
    assert value(text, 'kv_sidecar_requests_total{outcome="expired"}') == 1
    assert value(text, 'kv_sidecar_stage_seconds_count{stage="transfer"}') == 1
    assert value(text, 'kv_sidecar_stage_seconds_count{stage="handshake"}') == 0  # a pull's stage
    assert value(text, 'kv_sidecar_refusals_total{field="block_size"}') == 1
    assert value(text, 'kv_sidecar_handshakes_total{outcome="failed"}') == 1
    assert value(text, 'kv_sidecar_handshakes_total{outcome="refused"}') == 0  # exists from the start
    assert value(text, "kv_sidecar_bytes_pulled_total") == 4096
    assert value(text, f'kv_sidecar_build_info{{version="{__version__}"}}') == 1
    assert "mystery" not in text
    with pytest.raises(ValueError, match="outcome 'great'"):
        m.answered("great")


def test_two_daemons_in_one_process_do_not_share_a_registry():
    a, b = Metrics(), Metrics()
    a.answered("ok")
    assert value(b.expose().decode(), 'kv_sidecar_requests_total{outcome="ok"}') == 0


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_http_endpoint_health_and_readiness():
    m, health = Metrics(), Health(stall_s=5.0)
    server = start_http_server(m, health, "127.0.0.1", 0)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        status, ctype, body = get(server.url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain") and "kv_sidecar_ready" in body
        assert get(server.url + "/healthz")[::2] == (503, "starting\n")
        health.last_tick -= 10  # a start that takes long is starting, not stalled
        assert get(server.url + "/healthz")[::2] == (503, "starting\n")
        health.mark_started()
        assert get(server.url + "/healthz")[::2] == (200, "ok\n")
        status, _, body = get(server.url + "/readyz")
        assert status == 503
        assert body == "not ready, waiting for: socket bound, NIXL agent up, caches registered\n"
        health.socket_bound = health.agent_up = True
        assert get(server.url + "/readyz")[::2] == (503, "not ready, waiting for: caches registered\n")
        health.caches_registered = True
        assert get(server.url + "/readyz")[::2] == (200, "ok\n")
        health.last_tick -= 10  # the loop has not ticked for 10 s
        status, _, body = get(server.url + "/healthz")
        assert status == 503 and body.startswith("event loop stalled")
        health.tick()
        assert get(server.url + "/healthz")[0] == 200
        why: list[str | None] = [None]
        health.add_check(lambda: why[0])
        assert get(server.url + "/healthz")[0] == 200
        why[0] = "poster thread inside one NIXL call for 61 s"
        assert get(server.url + "/healthz")[::2] == (503, "poster thread inside one NIXL call for 61 s\n")
        why[0] = None
        assert get(server.url + "/healthz")[0] == 200
        health.stopping = True
        assert get(server.url + "/readyz")[2].startswith("not ready: shutting down")
        assert get(server.url + "/other")[0] == 404
    finally:
        server.close()


def test_fp8_reencode_counts_by_kind():
    from sidecar.ops.metrics import Metrics

    m = Metrics()
    m.fp8_reencode(3, 1)
    m.fp8_reencode(0, 2)
    text = m.expose().decode()
    assert 'kv_sidecar_fp8_reencoded_elements_total{kind="saturated"} 3.0' in text
    assert 'kv_sidecar_fp8_reencoded_elements_total{kind="nan"} 3.0' in text


def test_conversion_launches_count_by_path_from_zero():
    from sidecar.ops.metrics import Metrics

    m = Metrics()
    text = m.expose().decode()
    assert 'kv_sidecar_conversion_launches_total{path="graph"} 0.0' in text  # present before any launch
    m.launched("graph")
    m.launched("graph")
    m.launched("ordinary")
    text = m.expose().decode()
    assert 'kv_sidecar_conversion_launches_total{path="graph"} 2.0' in text
    assert 'kv_sidecar_conversion_launches_total{path="ordinary"} 1.0' in text
    with pytest.raises(KeyError):
        m.launched("eager")


def test_gates_forced_open_count_from_zero():
    from sidecar.ops.metrics import Metrics

    m = Metrics()
    assert "kv_sidecar_conversion_gates_forced_total 0.0" in m.expose().decode()  # an alert can watch it
    m.gates_forced_open(2)
    assert "kv_sidecar_conversion_gates_forced_total 2.0" in m.expose().decode()
