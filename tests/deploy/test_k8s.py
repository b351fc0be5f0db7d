"""deploy/k8s: every manifest validated offline against the Kubernetes OpenAPI schemas (kubernetes-validate
ships them), the ServiceMonitor against the CRD fields it uses, and the pod wiring the daemon needs."""

from __future__ import annotations

import copy
import json
import socket
from pathlib import Path

import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# resource.k8s.io/v1 (DRA) is GA from 1.34; native sidecars from 1.29 (default on), GA 1.33.
MIN_VERSION = "1.34.0"
DECODERS = {"decoder.yaml": 1, "decoder-tp2.yaml": 2}
SHUFFLE_ENV = {"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1", "VLLM_KV_CACHE_LAYOUT": "LHBNC"}
GPU_RESOURCES = ("amd.com/gpu", "nvidia.com/gpu")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _all_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in _docs(p)]


@pytest.fixture
def no_network(monkeypatch):
    """Validation must work offline: any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during offline validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _versions() -> list[str]:
    return [MIN_VERSION, kv.utils.latest_version()]


@pytest.mark.parametrize("version", _versions())
def test_builtin_kinds_validate_strictly_offline(no_network, version):
    checked = 0
    for name, doc in _all_docs():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(
                f"{name} {doc['kind']}/{doc['metadata']['name']} @ {version}: {e.message} at "
                f"{'/'.join(map(str, e.absolute_path))}"
            )
        checked += 1
    assert checked >= 6


def test_the_validator_rejects_a_misspelt_field(no_network):
    doc = copy.deepcopy(_docs(K8S / "decoder.yaml")[0])
    doc["spec"]["template"]["spec"]["initContainers"][1]["restartPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, MIN_VERSION, strict=True)


def test_native_sidecar_is_rejected_by_a_pre_sidecar_schema(no_network):
    """restartPolicy on an init container is what makes it a native sidecar; 1.27 had no such field."""
    doc = _docs(K8S / "decoder.yaml")[0]
    with pytest.raises(kv.ValidationError) as e:
        kv.validate(doc, "1.27.0", strict=True)
    assert "'restartPolicy' was unexpected" in e.value.message
    assert list(e.value.absolute_path)[-2:] == ["initContainers", 1]


# A structural schema of the ServiceMonitor fields used here, typed as in the prometheus-operator CRD.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": {"type": "object"}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                        },
                    },
                },
            },
        },
    },
}


def test_service_monitor_matches_the_service_and_its_ports():
    (sm,) = _docs(K8S / "servicemonitor.yaml")
    jsonschema.validate(sm, SERVICE_MONITOR)
    services = {d["metadata"]["name"]: d for d in _docs(K8S / "service.yaml")}
    svc = services["kv-sidecar"]  # the job label the alert rules select (job=~"kv-sidecar.*")
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in svc_ports and ep["path"] == "/metrics"
    # Named target ports: a pod without that container port is left out instead of becoming a dead target.
    assert all(p["targetPort"] == name for name, p in svc_ports.items())


# ------------------------------------------------------------------------------------------ the decoder pod


def _pod(name: str) -> dict:
    (dep,) = [d for d in _docs(K8S / name) if d["kind"] == "Deployment"]
    return dep["spec"]["template"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def _sidecars(spec: dict) -> list[dict]:
    return [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]


def _vllm(spec: dict) -> dict:
    (c,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    return c


def _kv_transfer_config(vllm: dict) -> dict:
    args = vllm["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("name, tp", DECODERS.items())
def test_decoder_runs_vllm_with_the_sidecar_connector(name, tp):
    spec = _pod(name)["spec"]
    vllm = _vllm(spec)
    assert vllm["command"] == ["vllm"] and vllm["args"][0] == "serve"
    ktc = _kv_transfer_config(vllm)
    assert ktc == {
        "kv_connector": "SidecarConnector",
        "kv_connector_module_path": "vllm_glue.connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"sidecar_socket": "ipc:///run/kv-sidecar/gpu{rank}.sock"},
    }
    # Each TP rank's socket is the one its sidecar binds, inside the shared volume.
    sidecar_sockets = [_env(c)["KV_SIDECAR_SOCKET"] for c in _sidecars(spec)]
    socket = ktc["kv_connector_extra_config"]["sidecar_socket"]
    assert [socket.replace("{rank}", str(r)) for r in range(tp)] == sidecar_sockets
    assert socket.removeprefix("ipc://").startswith(_mounts(vllm)["sockets"] + "/")
    env = _env(vllm)
    assert {k: env.get(k) for k in SHUFFLE_ENV} == SHUFFLE_ENV
    assert ("--tensor-parallel-size=2" in vllm["args"]) == (tp == 2)
    assert "--block-size=16" in vllm["args"]  # shuffled pages need 16 or 32 (page-formats.md)


@pytest.mark.parametrize("name, tp", DECODERS.items())
def test_one_native_sidecar_per_gpu_sharing_socket_shm_and_the_gpu_claim(name, tp):
    pod = _pod(name)
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    vllm = _vllm(spec)
    sidecars = _sidecars(spec)
    assert [c["name"] for c in sidecars] == [f"kv-sidecar-gpu{i}" for i in range(tp)]
    claims = {c["name"] for c in spec["resourceClaims"]}
    vllm_claims = [c["name"] for c in vllm["resources"]["claims"]]
    assert set(vllm_claims) <= claims and vllm_claims
    vm = _mounts(vllm)
    ports = set()
    for gpu, sc in enumerate(sidecars):
        assert sc["args"][:3] == ["serve", "--gpu", str(gpu)]
        # The decoder's GPU through the same claim, and no device-plugin GPU of its own.
        assert [c["name"] for c in sc["resources"]["claims"]] == vllm_claims
        for section in ("limits", "requests"):
            assert not set(sc["resources"].get(section, {})) & set(GPU_RESOURCES)
        sm = _mounts(sc)
        for volume in ("sockets", "dshm"):
            assert sm[volume] == vm[volume], f"{sc['name']} and vllm must mount {volume} at one path"
        env = _env(sc)
        assert env["KV_SIDECAR_SOCKET"] == f"ipc://{sm['sockets']}/gpu{gpu}.sock"
        assert env["KV_SIDECAR_METRICS_HOST"] == "0.0.0.0"  # probes come from the kubelet, not loopback
        port = int(env["KV_SIDECAR_METRICS_PORT"])
        (cport,) = sc["ports"]
        assert cport["containerPort"] == port and cport["name"] == f"kv-metrics-gpu{gpu}"
        assert sc["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": cport["name"]}
        assert sc["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": cport["name"]}
        assert sc["startupProbe"]["httpGet"]["path"] == "/healthz"  # /readyz waits for vLLM: no deadlock
        ports.add(port)
    assert len(ports) == tp
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


@pytest.mark.parametrize("name", DECODERS)
def test_shim_reaches_vllm_from_the_sidecar_image(name):
    spec = _pod(name)["spec"]
    (install,) = [c for c in spec["initContainers"] if c["name"] == "install-shim"]
    assert spec["initContainers"][0] is install, "the shim must be copied before vLLM can start"
    src, dst = install["command"][-2:]
    assert src == "/opt/kv-sidecar/shim/."
    assert "COPY --from=build /shim /opt/kv-sidecar/shim" in (REPO / "Dockerfile").read_text()
    vllm = _vllm(spec)
    assert _mounts(vllm)["shim"] == dst.rstrip("/") == _env(vllm)["PYTHONPATH"]


@pytest.mark.parametrize("name", DECODERS)
def test_same_uid_for_vllm_and_sidecars(name):
    """cma and IPC fd imports need one user: set at pod level, overridden by no container."""
    spec = _pod(name)["spec"]
    assert spec["securityContext"]["runAsUser"] > 0
    for c in spec["containers"] + spec["initContainers"]:
        assert "runAsUser" not in c.get("securityContext", {}), c["name"]


def test_claim_templates_exist_for_each_decoder():
    templates = {d["metadata"]["name"]: d for d in _docs(K8S / "resourceclaimtemplate.yaml")}
    for name, tp in DECODERS.items():
        (claim,) = _pod(name)["spec"]["resourceClaims"]
        requests = templates[claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["requests"]
        assert sum(r["exactly"]["count"] for r in requests) == tp


def test_configmap_holds_the_shipped_toml():
    (cm,) = _docs(K8S / "configmap.yaml")
    assert cm["data"]["kv-sidecar.toml"] == (REPO / "deploy" / "kv-sidecar.toml").read_text()


@pytest.mark.parametrize("name", DECODERS)
def test_sidecar_config_loads_with_the_daemon_config_code(name, tmp_path):
    """The ConfigMap's TOML plus each container's KV_SIDECAR_* variables make a valid daemon config."""
    from sidecar.ops import config

    (cm,) = _docs(K8S / "configmap.yaml")
    path = tmp_path / "kv-sidecar.toml"
    path.write_text(cm["data"]["kv-sidecar.toml"])
    spec = _pod(name)["spec"]
    for gpu, sc in enumerate(_sidecars(spec)):
        cfg = config.load(str(path), environ=_env(sc), overrides={"gpu": gpu})
        assert cfg.metrics_host == "0.0.0.0"
        assert cfg.socket_endpoint == f"ipc:///run/kv-sidecar/gpu{gpu}.sock"
        assert cfg.remotes, "a prefill must be declared, or every pull is refused"
        assert sc["args"][sc["args"].index("--config") + 1] == f"{_mounts(sc)['config']}/kv-sidecar.toml"


def test_the_connector_the_flag_names_exists():
    """kv_connector_module_path and kv_connector resolve (read, not imported: the module imports vLLM)."""
    import importlib.util

    ktc = _kv_transfer_config(_vllm(_pod("decoder.yaml")["spec"]))
    spec = importlib.util.find_spec(ktc["kv_connector_module_path"])
    assert spec is not None and spec.origin
    source = Path(spec.origin).read_text()
    assert f"class {ktc['kv_connector']}(" in source
    for key in ktc["kv_connector_extra_config"]:
        assert f'"{key}"' in source, f"the connector reads no extra_config key {key!r}"


def _image_env() -> dict[str, str]:
    """The kv-sidecar image's ENV paths (Dockerfile): its containers' unless the pod sets them."""
    text = (REPO / "Dockerfile").read_text()
    return {k: v for k in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")
            for v in [text.split(f"{k}=", 1)[1].split()[0]]}


@pytest.mark.parametrize("name", DECODERS)
def test_home_and_caches_are_writable_under_a_read_only_root(name):
    """The daemon's HOME was the image's /var/lib/kv-sidecar on a read-only root: CUDA's JIT cache
    (~/.nv) and anything else a library keeps in HOME could not be written."""
    spec = _pod(name)["spec"]
    for c in _sidecars(spec) + [_vllm(spec)]:
        if not c.get("securityContext", {}).get("readOnlyRootFilesystem"):
            continue
        env = {**(_image_env() if c in _sidecars(spec) else {}), **_env(c)}
        mounted = [m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")]
        for key in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
            if key in env:
                path = env[key]
                under = any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted)
                assert under, (c["name"], key, path)
