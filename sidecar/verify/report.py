"""What ``kv-sidecar verify`` prints: a pass/fail table (rich), one JSON object, and one support-matrix row.

The JSON keys and the table columns are fixed by tests (tests/sidecar/verify/test_report.py): a bug report
pasted from one version must read the same as from the next.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Status = Literal["pass", "fail", "skip"]
TABLE_COLUMNS = ("check", "status", "detail")
JSON_KEYS = ("ok", "device", "platform", "versions", "support_row", "checks")
CHECK_KEYS = ("name", "status", "detail", "data")


class Check(msgspec.Struct, frozen=True):
    """One row: pass, fail or skip, and why."""

    name: str
    status: Status
    detail: str
    data: dict[str, Any] = {}


class Report(msgspec.Struct, frozen=True):
    ok: bool
    device: str  # "cpu", "cuda:0"
    platform: str  # "CPU", "CUDA 13.0 (NVIDIA H200)", "ROCm 6.4 (AMD Instinct MI300X)"
    versions: dict[str, str | None]
    support_row: str
    checks: list[Check]


def make_report(device: str, platform: str, versions: dict[str, str | None], checks: list[Check]) -> Report:
    ok = bool(checks) and not any(c.status == "fail" for c in checks)
    return Report(ok=ok, device=device, platform=platform, versions=versions,
                  support_row=support_row(platform, versions, checks), checks=checks)


def support_row(platform: str, versions: dict[str, str | None], checks: list[Check]) -> str:
    """One line for the README's support matrix: where, with what, and what passed."""
    golden = [c for c in checks if c.name.startswith("golden ")]
    passed = sum(c.status == "pass" for c in golden)
    readers = sorted({r for c in golden for r in c.data.get("readers", [])})
    status = {c.name: c.status for c in checks}
    transport = next((c.data.get("transports") for c in checks if c.name == "ucx transport"), None)
    ver = lambda name: versions.get(name) or "-"
    verdict = "PASS" if not any(c.status == "fail" for c in checks) and checks else "FAIL"
    parts = [
        f"{platform}", f"kv-sidecar {ver('kv-sidecar')}", f"torch {ver('torch')}", f"AITER {ver('aiter')}",
        f"NIXL {ver('nixl')}", f"vLLM {ver('vllm')}",
        f"verify {verdict}: golden {passed}/{len(golden)} (readers {'+'.join(readers) or '-'})",
        f"ipc {status.get('ipc', 'skip')}", f"nixl {status.get('nixl', 'skip')}"
        + (f" over {'+'.join(transport)}" if transport else ""),
        f"vllm flags {status.get('vllm', 'skip')}",
    ]
    return "| " + " | ".join(parts) + " |"


def to_json(report: Report) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2)


def render(report: Report, console: Any = None) -> None:
    """The table, then the support-matrix row."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"kv-sidecar verify on {report.platform} ({report.device})")
    for col in TABLE_COLUMNS:
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for c in report.checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
    console.print(table)
    console.print(f"result: {'[green]PASS[/]' if report.ok else '[bold red]FAIL[/]'}")
    console.print("support-matrix row:", markup=False)
    console.print(report.support_row, markup=False, soft_wrap=True)
