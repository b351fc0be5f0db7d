"""``kv-sidecar verify``: prove on this node's device that pages the daemon converts decode correctly.

Exit status: 0 when nothing failed, 1 when any check failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sidecar.verify.report import Check, Report, make_report, render, to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda or cuda:N (ROCm GPUs are 'cuda' in torch too); auto: the GPU if any")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': stdout, "
                        "and no table)")
    parser.add_argument("--no-probes", action="store_true", help="only the golden grid (no IPC/NIXL/vLLM)")
    parser.add_argument("--quick", action="store_true", help="one shape per dtype instead of the whole grid")


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch sees no GPU (torch {torch.__version__})")
        return name if ":" in name else f"cuda:{torch.cuda.current_device()}"
    if name != "cpu":
        raise ValueError(f"--device {name!r} is not cpu, cuda or cuda:N")
    return "cpu"


def platform_of(device: str) -> str:
    import torch

    if device == "cpu":
        return "CPU"
    gpu = torch.cuda.get_device_name(torch.device(device))
    if torch.version.hip:
        return f"ROCm {torch.version.hip} ({gpu})"
    return f"CUDA {torch.version.cuda} ({gpu})"


def pick_readers(device: str) -> tuple[dict, list[Check]]:
    """The readers this device runs, and a row for each one that should run here but cannot."""
    import torch

    from sidecar.verify import readers as rd

    chosen = {"torch": rd.decode_torch}
    rows: list[Check] = []
    if device == "cpu":
        return chosen, rows
    try:
        from sidecar.verify.triton_reader import decode_triton

        chosen["triton"] = decode_triton
    except ImportError as exc:
        rows.append(Check("reader triton", "fail", f"Triton is not importable on this GPU: {exc}"))
    if torch.version.hip:
        rows += _aiter_reader(chosen)
    return chosen, rows


def _aiter_reader(chosen: dict) -> list[Check]:
    """Add AITER's own decode (ROCm): the reader that matters there. A row saying why when it cannot run."""
    from importlib import metadata

    from sidecar.verify import readers as rd

    how = ("install the AITER your vLLM ROCm image ships (built from https://github.com/ROCm/aiter), or "
           "pip install 'kv-sidecar[rocm]' (PyPI amd-aiter, a pre-release)")
    try:
        import aiter  # lazy, ROCm only; JIT-compiles its HIP kernels on first use
    except Exception as exc:  # noqa: BLE001 - aiter raises RuntimeError too (no rocminfo, unknown gfx)
        why = f"aiter is not importable ({type(exc).__name__}: {exc}); {how}"
        return [Check("reader aiter", "fail", why)]
    if not hasattr(aiter, "paged_attention_common"):
        try:
            version = metadata.version("amd-aiter")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return [Check("reader aiter", "fail", f"aiter {version} has no paged_attention_common, which vLLM "
                      f"0.33's ROCM_AITER_FA shuffle decode calls (vllm/_aiter_ops.py L4683); {how}")]
    chosen["aiter"] = rd.decode_aiter
    return []


def golden_checks(device: str, readers: dict, quick: bool = False) -> list[Check]:
    """One row per shape (both conversion modes, every reader)."""
    import torch

    from sidecar.verify import golden

    shapes = golden.GOLDEN_GRID
    if quick:
        shapes = tuple(s for s in shapes if s.block_size == 16 and s.head_size == 128)
    rows = []
    for shape in shapes:
        try:
            results = [golden.run_shape(shape, torch.device(device), readers, mode=m)
                       for m in ("in_place", "staged")]
        except Exception as exc:  # noqa: BLE001 - a reader or conversion that raises fails its shape
            rows.append(Check(f"golden {shape.label}", "fail", f"{type(exc).__name__}: {exc}",
                              {"shape": _struct(shape), "readers": sorted(readers)}))
            continue
        ok = all(r.ok for r in results)
        parts = []
        for name in readers:
            worst = max(next(x for x in r.readers if x.reader == name).max_error for r in results)
            tol = golden.tolerance(name, shape.dtype)
            parts.append(f"{name} {worst:.1e}{'<=' if worst <= tol else ' > '}{tol:.0e}")
        bytes_ok = all(r.bytes_ok for r in results)
        detail = f"in place + staged; bytes {'as AITER reads them' if bytes_ok else 'DIFFER'}; max |err| " \
                 + ", ".join(parts)
        rows.append(Check(f"golden {shape.label}", "pass" if ok else "fail", detail,
                          {"shape": _struct(shape), "readers": sorted(readers),
                           "results": [_struct(r) for r in results]}))
    return rows


def _struct(obj: object) -> dict:
    import msgspec

    return msgspec.to_builtins(obj)


def run(args: argparse.Namespace) -> Report:
    from sidecar.cli import versions

    device = resolve_device(args.device)
    readers, rows = pick_readers(device)
    checks = rows + golden_checks(device, readers, quick=args.quick)
    if not args.no_probes:
        from sidecar.verify import probes

        checks += probes.check_ipc_nixl(device)
        checks.append(probes.check_vllm())
    return make_report(device, platform_of(device), versions(), checks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar verify", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except ValueError as exc:
        print(f"kv-sidecar verify: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        sys.stdout.buffer.write(to_json(report) + b"\n")
    else:
        render(report)
        if args.json:
            with open(args.json, "wb") as f:
                f.write(to_json(report) + b"\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
