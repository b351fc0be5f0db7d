"""A decoder stand-in: a process that owns shared-memory K/V planes and pulls into them through the vLLM shim.

It allocates what an AITER decoder allocates under LHBNC with shuffled pages (per layer a dense K plane then a
dense V plane, ``[B, 2, N, H*D]``) in a /dev/shm file, and drives :class:`vllm_glue.worker.WorkerHalf` (the
connector's worker half) exactly as vLLM's worker does: Hello, RegisterCaches, Pulls from step orders, Done
collected. :func:`run_session` creates requests at a prefill emulator, pulls them and checks every converted
block bit for bit against ``sidecar.convert``'s reference applied to the emulator's expected pages.

``python -m sidecar.standins.decoder --socket ipc://... --emulator-ready-file F`` runs one session and prints
a JSON summary (exit 0 only if every request was pulled and is bit-exact). ``--socket a,b`` acts as a decoder
at TP 2: one stand-in rank per daemon socket, every request pulled by both ranks, each holding its head slice.

Size: a whole stand-in process (planes, shim worker half, canary checks) with its CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat
from vllm_glue.load_tracker import LoadOutcome
from vllm_glue.orders import PullOrder, StepOrders, parse_remote
from vllm_glue.worker import WorkerHalf

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from sidecar.standins.emulator_control import EmulatorClient, NewRequestReply


class StandinShape(msgspec.Struct, frozen=True, kw_only=True):
    """The decoder's cache: ``num_blocks`` kernel blocks of ``block_size`` tokens (block 0 unused)."""

    layers: int = 2
    heads: int = 2
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "bfloat16"

    def page_format(self, kind: str, layout: str) -> PageFormat:
        """This shape's pages as ``kind`` in ``layout``."""
        return PageFormat(
            kind=kind,
            layout=layout,
            dtype=self.dtype,
            num_heads=self.heads,
            block_size=self.block_size,
            head_size=self.head_size,
        )

    @property
    def fmt(self) -> PageFormat:
        """The decoder's own pages: AITER-shuffled LHBNC."""
        return self.page_format(AITER_SHUFFLED, "LHBNC")

    @property
    def remote_fmt(self) -> PageFormat:
        """The prefill's pages of the same model: vLLM's standard LBHNC."""
        return self.page_format(STANDARD, "LBHNC")

    @property
    def plane_elems(self) -> int:
        """Elements of one plane-block (half a page)."""
        return self.heads * self.block_size * self.head_size

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.plane_elems * self.fmt.elem_bytes


class _DeviceBuffer:
    """A plain torch allocation standing where the stand-in keeps its shm buffer."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def close(self) -> bool:
        self.tensor = None
        return True


class DecoderStandin:
    """Owns the K/V planes and one :class:`WorkerHalf`; a tiny block allocator stands in for vLLM's.

    The planes live in /dev/shm on ``device="cpu"``, else in one torch allocation on ``device`` (VRAM on
    ``cuda:N``, exported by CUDA IPC at registration)."""

    def __init__(
        self,
        socket: str,
        shape: StandinShape,
        *,
        compat_factors: dict[str, Any],
        pull_timeout_s: float = 30.0,
        register_timeout_s: float = 30.0,
        seed: int = 0,
        device: str = "cpu",
        reap_shm: bool = True,
        worker_rank: int = 0,
        tp_size: int = 1,
    ) -> None:

        from sidecar.wire.ipc import create_shm_buffer, torch_dtype

        self.device = device
        self.shape = shape
        self.compat_factors = compat_factors
        nbytes = shape.layers * shape.layer_bytes
        if device == "cpu":
            self.buffer: Any = create_shm_buffer(nbytes)
            if reap_shm:  # gone with this process, even after SIGKILL (vLLM's connector does the same)
                from vllm_glue.shm_reaper import unlink_when_gone

                unlink_when_gone(os.getpid(), [self.buffer.path])
        else:
            import torch

            self.buffer = _DeviceBuffer(torch.zeros(nbytes, dtype=torch.uint8, device=device))
        dtype = torch_dtype(shape.dtype)
        flat = self.buffer.tensor.view(dtype)
        b, n, hd = shape.num_blocks, shape.block_size, shape.heads * shape.head_size
        self.kv_caches: dict[str, torch.Tensor] = {}
        per_layer = 2 * b * n * hd
        for layer in range(shape.layers):
            # vLLM's shuffled LHBNC view: slot 0 is the K plane over all blocks, slot 1 the V plane.
            self.kv_caches[f"model.layers.{layer}.self_attn.attn"] = flat.as_strided(
                (b, 2, n, hd), (n * hd, b * n * hd, hd, 1), layer * per_layer
            )
        self.worker = WorkerHalf(
            socket,
            pull_timeout_s=pull_timeout_s,
            register_timeout_s=register_timeout_s,
            worker_rank=worker_rank,
            tp_size=tp_size,
        )
        self.rank, self.tp_size = worker_rank, tp_size
        self._rng = random.Random(seed)
        self._free = list(range(1, shape.num_blocks))  # block 0 is vLLM's null block
        self._rng.shuffle(self._free)
        self._sent_ns: dict[str, int] = {}
        # What vLLM's scheduler would have received, one entry per step that reported something:
        # (finished_recving, failed_recving, invalid_block_ids).
        self.reports: list[tuple[set[str], set[str], set[int]]] = []

    # ------------------------------------------------------------------------------------------- setup

    def register(self) -> bool:
        """Export the planes and register them with the daemon (as register_kv_caches does)."""
        return self.worker.register(self.kv_caches, self.shape.fmt, self.compat_factors)

    def close(self) -> None:
        self.worker.shutdown()
        self.kv_caches.clear()
        self.buffer.close()

    def __enter__(self) -> DecoderStandin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- blocks

    def allocate(self, n: int) -> list[int]:
        """n free blocks, in the scattered order vLLM's free queue hands them out."""
        if n > len(self._free):
            raise RuntimeError(f"decoder out of blocks: need {n}, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def allocate_ids(self, block_ids: list[int]) -> None:
        """Take exactly these blocks (another TP rank's allocation: vLLM's ranks share one block table)."""
        taken = set(block_ids)
        if not taken <= set(self._free):
            missing = sorted(taken - set(self._free))[:5]
            raise RuntimeError(f"blocks {missing} are not free on rank {self.rank}")
        self._free = [b for b in self._free if b not in taken]

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def k_plane(self, layer: int) -> torch.Tensor:
        """Layer's K plane as [blocks, H*D*N] elements (a view of the shared memory)."""
        t = self.kv_caches[f"model.layers.{layer}.self_attn.attn"]
        return t.select(1, 0).reshape(self.shape.num_blocks, -1)

    def v_plane(self, layer: int) -> torch.Tensor:
        t = self.kv_caches[f"model.layers.{layer}.self_attn.attn"]
        return t.select(1, 1).reshape(self.shape.num_blocks, -1)

    # ------------------------------------------------------------------------------------------- loads

    def pull(self, orders: list[PullOrder], aborts: list[str] = ()) -> None:
        """One engine step's worth of orders, sent as the connector's start_load_kv sends them."""
        now = time.monotonic_ns()
        for o in orders:
            self._sent_ns[o.req_id] = now
        self.worker.start_step(StepOrders(pulls=list(orders), aborts=list(aborts)))

    def wait(self, req_ids: set[str], timeout_s: float, poll_s: float = 0.002) -> dict[str, LoadOutcome]:
        """Step until every id is reported (finished or failed) or the timeout; returns their outcomes."""
        want = set(req_ids)
        got: dict[str, LoadOutcome] = {}
        deadline = time.monotonic() + timeout_s
        while want - got.keys():
            res = self.worker.transfer_results()
            bad = self.worker.load_errors()
            if res.finished or res.failed or bad:
                self.reports.append((res.finished, res.failed, bad))
            for o in self.worker.tracker.outcomes:
                if o.req_id in want:
                    got[o.req_id] = o
            self.worker.tracker.outcomes.clear()
            if not want - got.keys() or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        return got

    def reported(self, req_id: str) -> list[tuple[bool, set[int]]]:
        """Each step that reported ``req_id`` finished: (also failed?, that step's invalid blocks)."""
        return [(req_id in failed, bad) for finished, failed, bad in self.reports if req_id in finished]

    def round_trip_s(self, outcome: LoadOutcome) -> float | None:
        sent = self._sent_ns.pop(outcome.req_id, None)
        return None if sent is None else outcome.received_at - sent / 1e9


# ------------------------------------------------------------------------------------------- verification


def expected_planes(
    reply: NewRequestReply,
    seed: int,
    remote_fmt: PageFormat,
    layer: int,
    count: int,
    *,
    remote_tp: int = 1,
    local_tp: int = 1,
    local_rank: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The K and V plane-blocks the last ``count`` remote kernel blocks of ``layer`` must become (uint8 rows).

    The emulator's expected pages, converted out of place by sidecar.convert (the torch reference on a CPU).
    Across TP, the model's page is every prefill rank's heads in rank order (``remote_fmt`` is one rank's),
    and decoder rank ``local_rank`` holds the ``local_rank``-th of ``local_tp`` equal runs of them.
    """
    import torch

    from sidecar.convert import convert_standard_to_shuffled
    from sidecar.standins.emulator_pages import expected_pages
    from sidecar.wire.ipc import torch_dtype

    kb = reply.kernel_block_ids[len(reply.kernel_block_ids) - count :]
    gens = reply.block_generations[len(reply.block_generations) - count :]
    per_rank = [expected_pages(seed, layer, kb, gens, remote_fmt, r) for r in range(remote_tp)]
    whole = np.concatenate(per_rank, 1)
    share = whole.shape[1] // local_tp
    mine = np.ascontiguousarray(whole[:, local_rank * share : (local_rank + 1) * share])
    heads = remote_fmt.num_heads * remote_tp // local_tp
    remote_fmt = msgspec.structs.replace(remote_fmt, num_heads=heads)  # this rank's page: its heads only
    pages = torch.from_numpy(mine).view(torch_dtype(remote_fmt.dtype))
    half = remote_fmt.plane_block_bytes // remote_fmt.elem_bytes
    k = torch.zeros((count, half), dtype=pages.dtype)
    v = torch.zeros((count, half), dtype=pages.dtype)
    convert_standard_to_shuffled(
        k,
        v,
        torch.arange(count),
        num_heads=remote_fmt.num_heads,
        block_size=remote_fmt.block_size,
        head_size=remote_fmt.head_size,
        src=pages,
    )
    return k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()


def mismatched_blocks(
    standin: DecoderStandin,
    reply: NewRequestReply,
    local_ids: list[int],
    seed: int,
    remote_fmt: PageFormat,
    remote_tp: int = 1,
) -> list[str]:
    """Every (layer, local block, plane) whose bytes differ from the reference conversion ([]: bit-exact)."""
    import torch

    bad: list[str] = []
    for layer in range(standin.shape.layers):
        k_exp, v_exp = expected_planes(
            reply, seed, remote_fmt, layer, len(local_ids),
            remote_tp=remote_tp, local_tp=standin.tp_size, local_rank=standin.rank,
        )
        ids = torch.tensor(local_ids, dtype=torch.long, device=standin.k_plane(layer).device)
        k_got = standin.k_plane(layer).index_select(0, ids).contiguous().view(torch.uint8).cpu().numpy()
        v_got = standin.v_plane(layer).index_select(0, ids).contiguous().view(torch.uint8).cpu().numpy()
        for i, b in enumerate(local_ids):
            if not np.array_equal(k_got[i], k_exp[i]):
                bad.append(f"layer {layer} block {b} K plane")
            if not np.array_equal(v_got[i], v_exp[i]):
                bad.append(f"layer {layer} block {b} V plane")
    return bad


# ------------------------------------------------------------------------------------------- a session


@dataclass
class RequestResult:
    req_id: str
    remote_request_id: str
    num_tokens: int
    local_block_ids: list[int]
    ok: bool
    reason: str | None
    timings: dict[str, float]
    round_trip_s: float | None
    bytes: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.ok and not self.mismatches


def run_session(
    standin: DecoderStandin,
    emulator: EmulatorClient,
    *,
    requests: int,
    seed: int,
    remote_fmt: PageFormat,
    tokens: tuple[int, int] = (1, 200),
    concurrency: int = 0,
    timeout_s: float = 30.0,
    rng_seed: int = 1,
    verify: bool = True,
) -> list[RequestResult]:
    """Create ``requests`` prefilled requests at the emulator, pull them ``concurrency`` at a time (0: all at
    once), and check every converted block. Blocks are returned to the stand-in's pool afterwards.
    """
    rng = random.Random(rng_seed)
    pending = []
    for i in range(requests):
        reply = emulator.new_request(num_tokens=rng.randint(*tokens), external_id=f"demo-{rng_seed}-{i}")
        params = reply.kv_transfer_params
        local = standin.allocate(len(reply.kernel_block_ids))
        order = PullOrder(f"dec-{rng_seed}-{i}", parse_remote(params), local, True, time.monotonic_ns())
        pending.append((order, reply))
    wave = concurrency or len(pending)
    results: list[RequestResult] = []
    page_half = remote_fmt.plane_block_bytes
    for start in range(0, len(pending), wave):
        batch = pending[start : start + wave]
        standin.pull([o for o, _ in batch])
        outcomes = standin.wait({o.req_id for o, _ in batch}, timeout_s)
        for order, reply in batch:
            out = outcomes.get(order.req_id)
            ok = out is not None and out.ok
            res = RequestResult(
                req_id=order.req_id,
                remote_request_id=order.remote.request_id,
                num_tokens=reply.num_tokens,
                local_block_ids=order.local_block_ids,
                ok=ok,
                reason=None if ok else (out.reason if out else f"no answer within {timeout_s:g} s"),
                timings=dict(out.timings) if out else {},
                round_trip_s=standin.round_trip_s(out) if out else None,
                bytes=2 * page_half * len(order.local_block_ids) * standin.shape.layers if ok else 0,
            )
            if ok and verify:
                res.mismatches = mismatched_blocks(standin, reply, order.local_block_ids, seed, remote_fmt)
            results.append(res)
            standin.release(order.local_block_ids)
    return results


def run_tp_session(
    standins: list[DecoderStandin],
    emulator: EmulatorClient,
    *,
    requests: int,
    seed: int,
    remote_fmt: PageFormat,
    tokens: tuple[int, int] = (1, 200),
    timeout_s: float = 30.0,
    rng_seed: int = 1,
) -> list[RequestResult]:
    """A decoder at TP ``len(standins)`` (one stand-in per rank, each with its daemon): every request pulled
    by every rank into the same block ids, as vLLM's ranks do, and each rank's heads checked bit for bit.
    ``remote_fmt`` is one prefill rank's pages; the prefill's TP comes from its kv_transfer_params."""
    rng = random.Random(rng_seed)
    made = []
    for i in range(requests):
        reply = emulator.new_request(num_tokens=rng.randint(*tokens), external_id=f"tp-{rng_seed}-{i}")
        remote = parse_remote(reply.kv_transfer_params)
        local = standins[0].allocate(len(reply.kernel_block_ids))
        for s in standins[1:]:
            s.allocate_ids(local)
        made.append((f"tp-{rng_seed}-{i}", remote, local, reply))
    for s in standins:
        s.pull([PullOrder(rid, remote, local, True, time.monotonic_ns()) for rid, remote, local, _ in made])
    results: list[RequestResult] = []
    for s in standins:
        outcomes = s.wait({rid for rid, *_ in made}, timeout_s)
        for rid, remote, local, reply in made:
            out = outcomes.get(rid)
            ok = out is not None and out.ok
            res = RequestResult(
                req_id=f"{rid}@rank{s.rank}",
                remote_request_id=remote.request_id,
                num_tokens=reply.num_tokens,
                local_block_ids=local,
                ok=ok,
                reason=None if ok else (out.reason if out else f"no answer within {timeout_s:g} s"),
                timings=dict(out.timings) if out else {},
                round_trip_s=s.round_trip_s(out) if out else None,
                bytes=s.shape.fmt.page_bytes * len(local) * s.shape.layers if ok else 0,
            )
            if ok:
                res.mismatches = mismatched_blocks(s, reply, local, seed, remote_fmt, remote.tp_size)
            results.append(res)
    for s in standins:
        for _, _, local, _ in made:
            s.release(local)
    return results


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(results: list[RequestResult]) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}
    for r in results:
        if r.ok:
            for k, v in r.timings.items():
                stages.setdefault(k, []).append(v)
            if r.round_trip_s is not None:
                stages.setdefault("shim_round_trip", []).append(r.round_trip_s)
    return {
        "requests": len(results),
        "ok": sum(r.exact for r in results),
        "failed": sum(not r.ok for r in results),
        "mismatched": sum(bool(r.mismatches) for r in results),
        "bytes": sum(r.bytes for r in results),
        "stages": {
            k: {"p50_ms": 1e3 * percentile(v, 50), "p99_ms": 1e3 * percentile(v, 99), "n": len(v)}
            for k, v in sorted(stages.items())
        },
        "failures": [
            f"{r.req_id}: {r.reason or '; '.join(r.mismatches[:3])}" for r in results if not r.exact
        ],
    }


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = StandinShape()
    a = parser.add_argument
    a("--socket", required=True, help="the daemon's ipc:// socket; a,b,...: one daemon per decoder TP rank")
    a(
        "--emulator-ready-file",
        required=True,
        help="the prefill emulator's --ready-file (its control endpoint and model identity)",
    )
    a("--layers", type=int, default=d.layers)
    a("--heads", type=int, default=d.heads, help="KV heads per decoder TP rank")
    a("--head-size", type=int, default=d.head_size)
    a("--block-size", type=int, default=d.block_size)
    a("--num-blocks", type=int, default=d.num_blocks, help="decoder blocks per layer")
    a("--dtype", default=d.dtype)
    a("--requests", type=int, default=16)
    a("--concurrency", type=int, default=0, help="pulls in flight at once (0: all)")
    a("--max-tokens", type=int, default=200, help="prompt lengths are drawn from 1..this")
    a("--seed", type=int, default=0, help="the emulator's page seed")
    a("--timeout", type=float, default=30.0)
    a("--prefill-heads", type=int, default=0, help="KV heads per prefill TP rank (0: as the decoder's)")


def run(args: argparse.Namespace) -> int:
    from sidecar.standins.emulator_control import EmulatorClient, ReadyInfo

    with open(args.emulator_ready_file, "rb") as f:
        ready = msgspec.json.decode(f.read().strip(), type=ReadyInfo)
    shape = StandinShape(
        layers=args.layers,
        heads=args.heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        dtype=args.dtype,
    )
    remote_fmt = shape.remote_fmt
    sockets = args.socket.split(",")
    if len(sockets) > 1 or args.prefill_heads:
        return _run_tp(args, sockets, shape, ready)
    emulator = EmulatorClient(ready.control)
    try:
        # The decoder serves the same model as the prefill: its factors (the daemon swaps in each backend
        # name).
        with DecoderStandin(
            args.socket, shape, compat_factors=dict(ready.compat_factors), pull_timeout_s=args.timeout
        ) as standin:
            if not standin.register():
                print(json.dumps({"error": f"not registered: {standin.worker.client.status_reason}"}))
                return 1
            results = run_session(
                standin,
                emulator,
                requests=args.requests,
                seed=args.seed,
                remote_fmt=remote_fmt,
                tokens=(1, args.max_tokens),
                concurrency=args.concurrency,
                timeout_s=args.timeout,
            )
    finally:
        emulator.close()
    summary = summarize(results)
    print(json.dumps(summary))
    return 0 if summary["ok"] == summary["requests"] else 1


def _run_tp(args: argparse.Namespace, sockets: list[str], shape: StandinShape, ready: Any) -> int:
    """One stand-in rank per socket, every request pulled by all of them (heterogeneous TP)."""
    from contextlib import ExitStack

    from sidecar.standins.emulator_control import EmulatorClient

    remote_fmt = msgspec.structs.replace(shape.remote_fmt, num_heads=args.prefill_heads or shape.heads)
    emulator = EmulatorClient(ready.control)
    try:
        with ExitStack() as stack:
            standins = [
                stack.enter_context(
                    DecoderStandin(
                        sock, shape, compat_factors=dict(ready.compat_factors), pull_timeout_s=args.timeout,
                        worker_rank=rank, tp_size=len(sockets),
                    )
                )
                for rank, sock in enumerate(sockets)
            ]
            for st in standins:
                if not st.register():
                    reason = st.worker.client.status_reason
                    print(json.dumps({"error": f"rank {st.rank} not registered: {reason}"}))
                    return 1
            results = run_tp_session(
                standins, emulator, requests=args.requests, seed=args.seed, remote_fmt=remote_fmt,
                tokens=(1, args.max_tokens), timeout_s=args.timeout,
            )
    finally:
        emulator.close()
    summary = summarize(results)
    print(json.dumps(summary))
    return 0 if summary["ok"] == summary["requests"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.standins.decoder", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
