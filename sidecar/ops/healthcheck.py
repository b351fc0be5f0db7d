"""Docker's HEALTHCHECK: ``GET /healthz`` where the container's daemon serves it.

The port is the daemon's own: its ``serve`` flags (read from PID 1's command line), its config file and the
``KV_SIDECAR_*`` variables, loaded as ``serve`` loads them, so ``serve --gpu 1`` is checked on 9465 and a
``metrics_port`` in the TOML file is honoured. Exit 0 when healthy, 1 otherwise, with one line saying why.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from typing import Any


def serve_argv(cmdline: bytes) -> list[str]:
    """The ``serve ...`` part of a NUL-separated command line (``python .../kv-sidecar serve --gpu 1``)."""
    words = [w.decode(errors="replace") for w in cmdline.split(b"\0") if w]
    if "serve" not in words:
        raise ValueError(f"not a kv-sidecar serve command line: {' '.join(words)!r}")
    return words[words.index("serve"):]


def health_url(argv: list[str]) -> str:
    """The daemon's ``/healthz`` URL for ``serve`` flags ``argv``; ValueError when it serves none. A config
    file that no longer loads is left out (``load_to_find``): the daemon runs what it loaded at start."""
    from sidecar.cli import build_parser, config_overrides
    from sidecar.ops import config as config_mod

    args = build_parser().parse_args(argv)
    cfg, note = config_mod.load_to_find(args.config, overrides=config_overrides(args))
    if note:
        print(note)
    url = cfg.local_metrics_url
    if url is None:
        raise ValueError(f"metrics_port = {cfg.http_port}: no fixed metrics endpoint to check")
    return url + "/healthz"


def open_local(url: str, timeout_s: float) -> Any:
    """``urlopen`` for the daemon's own HTTP endpoint, never through ``$http_proxy``: urllib sends every
    request through it unless ``NO_PROXY`` names the host (127.0.0.1 included), and a proxy cannot reach
    this host's loopback (Docker passes a client's proxy settings into containers). Also ``doctor``'s."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout_s)


def main(pid: int = 1, timeout_s: float = 2.0) -> int:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            url = health_url(serve_argv(f.read()))
        with open_local(url, timeout_s) as r:
            print(f"{url}: {r.status}")
        return 0
    except urllib.error.HTTPError as exc:
        print(f"{exc.url}: {exc.code} {exc.read().decode(errors='replace').strip()}")
    except Exception as exc:  # noqa: BLE001 - any failure is unhealthy, said in one line
        print(f"unhealthy: {type(exc).__name__}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
