"""Launchers for the e2e tests: the prefill emulator and the daemon as real subprocesses, shapes, logs."""

from __future__ import annotations

import os
import uuid
from typing import Any

from sidecar.standins.decoder import StandinShape
from sidecar.wire.formats import STANDARD, PageFormat

LAYERS, HEADS, HEAD_SIZE, BLOCK = 2, 2, 128, 16
SHAPE = StandinShape(layers=LAYERS, heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK, num_blocks=512)
REMOTE_FMT = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BLOCK, head_size=HEAD_SIZE
)
ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


def toml_format(f: PageFormat) -> str:
    return (
        f'{{kind = "{f.kind}", layout = "{f.layout}", dtype = "{f.dtype}", num_heads = {f.num_heads}, '
        f"block_size = {f.block_size}, head_size = {f.head_size}}}"
    )


def start_emulator(work: str, *extra: str) -> Any:
    from sidecar.standins.emulator_control import spawn_emulator

    args = [
        "--layers",
        str(LAYERS),
        "--heads",
        str(HEADS),
        "--head-size",
        str(HEAD_SIZE),
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        "1024",
        "--control",
        f"ipc://{work}/emu-{uuid.uuid4().hex[:8]}.sock",
        "--no-progress-thread",  # each spinning prefill would take one of CI's two cores
        *extra,
    ]
    return spawn_emulator(args, 60.0, ENV)


def start_daemon(
    work: str, *, declared: PageFormat | None = REMOTE_FMT, extra: str = "", name: str = "d"
) -> Any:
    from sidecar.cli import spawn_serve

    lines = [
        f'socket = "ipc://{work}/{name}.sock"',
        "metrics_port = 0",
        'log_level = "INFO"',
        extra,
        "",
        "[[remotes]]",
        'match = "127.0.0.1:*"',
    ]
    if declared is not None:
        lines.append(f"page_format = {toml_format(declared)}")
    path = os.path.join(work, f"{name}.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    log = open(os.path.join(work, f"{name}.log"), "ab")  # noqa: SIM115 - the daemon writes it until it stops
    try:
        return spawn_serve(["--config", path], timeout_s=60.0, env=ENV, stderr=log)
    finally:
        log.close()


def log_tail(work: str, name: str = "d", lines: int = 40) -> str:
    try:
        with open(os.path.join(work, f"{name}.log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
