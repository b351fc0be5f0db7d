"""The test pull of ``kv-sidecar doctor``: one request read from a prefill emulator by a NIXL agent of ours.

``run_probe`` runs ``probe_pull`` in a subprocess with ``UCX_LOG_LEVEL=info`` (UCX reads it once, at
start), so doctor's ``check_test_pull`` can show which UCX transports carried the bytes. The pull reads into
a DRAM buffer of its own: it never touches the decoder's cache.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping

import msgspec

from sidecar.wire.formats import PageFormat

PROBE_MARK = "KV_SIDECAR_PROBE "


class PullProbeResult(msgspec.Struct, frozen=True):
    ok: bool
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    freed: bool = False


class EmulatorSpec(msgspec.Struct, frozen=True):
    """What doctor knows of an emulator it started: enough to recompute its pages."""

    seed: int
    format: PageFormat

    def emulator_args(self, layers: int = 2, num_blocks: int = 16) -> list[str]:
        """The prefill emulator's command-line arguments for this spec, on loopback. No spinning progress
        thread: doctor runs on a busy production node."""
        f = self.format
        return ["--host", "127.0.0.1", "--layers", str(layers), "--heads", str(f.num_heads), "--head-size",
                str(f.head_size), "--block-size", str(f.block_size), "--dtype", f.dtype, "--num-blocks",
                str(num_blocks), "--seed", str(self.seed), "--no-progress-thread"]


def probe_pull(control: str, spec: EmulatorSpec | None, timeout_s: float, blocks: int = 4) -> PullProbeResult:
    """One request of the emulator read into our own DRAM buffer; bytes checked when its spec is known."""
    import numpy as np

    from sidecar.nixl import agent as tr
    from sidecar.nixl import errors
    from sidecar.nixl.geometry import RemoteRegions
    from sidecar.standins.emulator_control import ControlError, EmulatorClient
    from sidecar.standins.emulator_pages import expected_pages
    from sidecar.wire import prefill as vllm_wire
    from sidecar.wire.formats import Plan

    ctl = EmulatorClient(control, timeout_s=timeout_s)
    try:
        req = ctl.new_request(num_blocks=blocks)
    except ControlError as exc:
        return PullProbeResult(False, f"emulator control {control}: {exc}")
    params = req.kv_transfer_params
    try:
        reply = vllm_wire.fetch_handshake(
            params["remote_host"], params["remote_port"], [(0, 0)], timeout_s=timeout_s
        )[(0, 0)]
    except (vllm_wire.HandshakeTimeout, vllm_wire.HandshakeDropped, vllm_wire.WireError) as exc:
        return PullProbeResult(False, f"emulator side channel: {exc}")
    meta = reply.metadata
    regions = RemoteRegions.from_metadata(meta, default_mem_type="DRAM")
    page, kb, layers = int(regions.block_len[0]), list(req.kernel_block_ids), regions.num_regions
    # A whole-page read needs no real format; the spec's, when known, lets us check the bytes.
    fmt = (
        spec.format
        if spec is not None
        else PageFormat(
            kind="standard",
            layout="LBHNC",
            dtype="uint8",
            num_heads=1,
            block_size=meta.block_size,
            head_size=max(1, page // (2 * meta.block_size)),
        )
    )
    if fmt.page_bytes != page:
        return PullProbeResult(
            False, f"the emulator's pages are {page} bytes, its spec says {fmt.page_bytes}"
        )
    t = tr.NixlTransfer(tr.TransferSettings(name_prefix="kv-sidecar-doctor"))
    try:
        peer = t.add_peer(
            engine_id=meta.engine_id,
            tp_rank=0,
            generation=0,
            address=f"{params['remote_host']}:{params['remote_port']}",
            agent_metadata=meta.agent_metadata,
            plan=Plan(fmt, fmt, False),
            regions=regions,
        )
        buf = np.zeros((layers, len(kb), page), np.uint8)
        t.register([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
        base = buf.ctypes.data
        local = np.array(
            [[base + (li * len(kb) + i) * page, page, 0] for li in range(layers) for i in range(len(kb))],
            np.uint64,
        )
        remote = np.array(
            [
                [int(regions.base[li]) + b * int(regions.block_stride[li]), page, regions.device_id]
                for li in range(layers)
                for b in kb
            ],
            np.uint64,
        )
        t0 = time.perf_counter()
        pull = t.start(peer, params["remote_request_id"], timeout_s=timeout_s)
        t.read_descs(pull, local, remote, "DRAM")
        t.seal(pull)
        t.wait(pull)
        seconds = time.perf_counter() - t0
        verified = False
        if spec is not None:
            for li in range(layers):
                want = expected_pages(spec.seed, li, kb, req.block_generations, fmt)
                if not np.array_equal(want, buf[li]):
                    return PullProbeResult(
                        False,
                        f"layer {li}: the bytes read differ from the emulator's pages",
                        buf.nbytes,
                        seconds,
                    )
            verified = True
        try:
            freed = (
                ctl.wait_state(params["remote_request_id"], "freed_by_notif", timeout_s).state
                == "freed_by_notif"
            )
        except ControlError as exc:
            return PullProbeResult(
                False,
                f"completion notification not seen by the emulator: {exc}",
                buf.nbytes,
                seconds,
                verified,
            )
        return PullProbeResult(True, "", buf.nbytes, seconds, verified, freed)
    except errors.TransferError as exc:
        return PullProbeResult(False, f"NIXL: {exc}")
    finally:
        t.close()
        ctl.close()


def _probe_main() -> None:
    """Entry of the probe subprocess: argv = control, EmulatorSpec JSON ('' unknown), timeout_s."""
    control, spec, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    result = probe_pull(control, msgspec.json.decode(spec, type=EmulatorSpec) if spec else None, timeout_s)
    sys.stdout.flush()
    print(PROBE_MARK + msgspec.json.encode(result).decode(), flush=True)


def run_probe(
    control: str, spec: EmulatorSpec | None, timeout_s: float, env: Mapping[str, str]
) -> tuple[PullProbeResult, str]:
    """The probe in a subprocess with UCX_LOG_LEVEL=info (UCX reads it once, at start): result and UCX log."""
    code = "from sidecar.ops.doctor_pull import _probe_main; _probe_main()"
    penv = {**env, "UCX_LOG_LEVEL": "info"}
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                control,
                "" if spec is None else msgspec.json.encode(spec).decode(),
                str(timeout_s),
            ],
            env=penv,
            capture_output=True,
            text=True,
            timeout=timeout_s * 6 + 60,
        )
    except subprocess.TimeoutExpired:
        return PullProbeResult(False, "the test pull did not finish in time"), ""
    log = out.stdout + out.stderr
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith(PROBE_MARK)), None)
    if line is None:
        return PullProbeResult(False, f"probe exited rc={out.returncode}: {log.strip()[-600:]}"), log
    return msgspec.json.decode(line[len(PROBE_MARK) :], type=PullProbeResult), log


# The emulator doctor starts: small, and with known contents so the test pull can check every byte.
EMULATOR_SPEC = EmulatorSpec(
    seed=20251129,
    format=PageFormat(
        kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=2, block_size=16, head_size=128
    ),
)
