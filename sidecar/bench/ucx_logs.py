"""UCX's own logs of a bench process: its log settings (``ucx_env``) and what the log says carried the reads.

With ``UCX_PROTO_INFO=y`` UCX prints a table per operation naming the protocol and transport it chose;
``summarize_ucx_logs`` keeps the remote-read tables, the endpoint lanes and notes on cuda_ipc.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec


class ProtoRow(msgspec.Struct, frozen=True):
    range: str
    description: str
    config: str


class ProtoTable(msgspec.Struct, frozen=True):
    """One ``UCX_PROTO_INFO=y`` table: which protocol and transport UCX chose for an operation."""

    pid: int
    agent: str
    scope: str  # self, intra-node, inter-node
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into cuda memory from cuda"
    rows: list[ProtoRow]


_PREFIX = re.compile(
    r"^\[(?P<ts>[\d.]+)\]\s+\[(?P<host>[^:\]]+):(?P<pid>\d+)\s*:(?P<tid>\d+)\]\s?(?P<rest>.*)$"
)
_TABLE_HEAD = re.compile(r"^(?P<agent>\S+)\s+(?P<scope>[\w-]+)\s+cfg#\d+$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w.:-]+")
_NOTE = re.compile(r"nvlink|cuda[-_]ipc|zcopy|cuda_copy|gdr_copy", re.IGNORECASE)


def parse_proto_tables(text: str) -> list[ProtoTable]:
    """Every protocol-selection table in a UCX log. A table starts at its ``<agent> <scope> cfg#N`` line,
    then names the operation, then lists ``Range | Description | Config`` rows; lines are followed per
    (pid, thread), so tables printed by two threads at once do not mix."""
    open_tables: dict[tuple[str, str], dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _PREFIX.match(line)
        if m is None:
            continue
        rest = m["rest"].strip()
        if not rest.startswith("|"):
            continue
        key = (m["pid"], m["tid"])
        cells = [c.strip() for c in rest.strip("|").split("|")]
        head = _TABLE_HEAD.match(cells[0]) if len(cells) == 1 else None
        current = open_tables.get(key)
        if head is not None:
            current = {
                "pid": int(m["pid"]),
                "agent": head["agent"],
                "scope": head["scope"],
                "op": None,
                "rows": [],
            }
            open_tables[key] = current
            done.append(current)
        elif current is None:
            continue
        elif len(cells) == 1 and current["op"] is None:
            current["op"] = cells[0]
        elif len(cells) == 3 and cells[0] != "Range":
            current["rows"].append(ProtoRow(*cells))
    return [
        ProtoTable(t["pid"], t["agent"], t["scope"], t["op"], t["rows"]) for t in done if t["op"] is not None
    ]


def transports_of(config: str) -> list[str]:
    """Transport names in a table's Config cell: ``"cuda_ipc/cuda"`` -> ["cuda_ipc"]."""
    return sorted(set(_TRANSPORT.findall(config)))


def summarize_ucx_logs(paths: Sequence[str], agent_prefix: str = "") -> dict[str, Any]:
    """What UCX says it used: endpoint lanes, the protocols chosen for remote reads, and notes on cuda_ipc."""
    from sidecar.ops.doctor import parse_ucx_lanes

    lanes, reads, notes = [], [], []
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for ln in parse_ucx_lanes(text):
            lanes.append({"scope": ln.scope, "lanes": ln.lanes})
        for t in parse_proto_tables(text):
            if t.scope == "self" or not t.operation.startswith("remote memory read"):
                continue
            if agent_prefix and not t.agent.startswith(agent_prefix):
                continue
            reads.append(
                {
                    "agent": t.agent,
                    "scope": t.scope,
                    "operation": t.operation,
                    "rows": [msgspec.to_builtins(r) for r in t.rows],
                    "transports": sorted({x for r in t.rows for x in transports_of(r.config)}),
                }
            )
        for line in text.splitlines():
            m = _PREFIX.match(line)
            rest = m["rest"].strip() if m else line
            table_or_lanes = rest.startswith(("|", "+")) or " cfg#" in rest
            if _NOTE.search(rest) and not table_or_lanes and len(notes) < 20:
                notes.append(rest[:300])
    used = sorted({x for r in reads for x in r["transports"]})
    unique_lanes = [dict(t) for t in {json.dumps(x, sort_keys=True): x for x in lanes}.values()]
    return {"read_transports": used, "reads": reads, "endpoint_lanes": unique_lanes, "notes": notes}


def ucx_env(logs: Path, role: str, level: str, cuda: bool) -> dict[str, str]:
    """UCX/NIXL settings of one process: its own UCX log file, protocol tables on, cuda_ipc reads allowed."""
    env = {
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "UCX_LOG_LEVEL": level,
        "UCX_PROTO_INFO": "y",
        "UCX_LOG_FILE": str(logs / f"ucx-{role}-%p.log"),
    }
    if cuda:
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    return env
