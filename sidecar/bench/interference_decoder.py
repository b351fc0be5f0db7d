"""The interference bench's decoder under ``--source daemon``: decode steps and real pulls in one process.

It is what a vLLM worker is to kv-sidecar: it owns the paged KV cache (the decoder stand-in's shuffled LHBNC
planes, ``sidecar.standins.decoder.DecoderStandin``), exports it through the shim's worker half
(``vllm_glue.worker.WorkerHalf``: Hello, RegisterCaches over the real socket) and, at each step boundary,
sends the Pulls of the requests whose prefill finished since the last step and collects the Dones -- as the
connector's ``start_load_kv`` / ``get_finished`` do. Requests are finished at the prefill emulator by a
thread at Poisson arrival times (``--keep-bytes``: the same pages served again and again). Every decode step
(``decode_step.DecodeStep``) is timed by GPU events mapped to the host clock; each request records its
arrival, Pull sent and Done received (the shim's receiver thread stamps it). After each phase the first
answered request is checked bit for bit against the emulator's pages (``e2e_roles.mismatched_planes``).

``python -m sidecar.bench.interference_decoder``: a ``DecoderConfig`` JSON line on stdin, then commands.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import msgspec
import numpy as np

from sidecar.bench import interference_stats as st
from sidecar.bench.interference_roles import Clock, _read, _say


def shape_of(tiny: bool) -> Any:
    """Qwen3-8B, or a tiny model (CPU tests) whose head size the daemon converts (64, 128 or 256)."""
    import dataclasses

    from sidecar.bench.decode_step import TINY, ModelShape

    return dataclasses.replace(TINY, head_size=64) if tiny else ModelShape()


class DecoderConfig(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    tiny: bool
    batch: int
    context_min: int
    context_max: int
    seed: int
    socket: str  # the daemon's
    emulator_control: str
    compat_factors: dict[str, Any]
    emulator_seed: int
    max_context: int  # largest request pulled: sizes the pull slots
    pull_slots: int  # requests in flight at once (their local blocks)
    timeout_s: float
    verify_layers: int


class RunPhase(msgspec.Struct, frozen=True, tag_field="cmd", tag="run"):
    """Decode steps for ``seconds``; pulls of ``context`` tokens arriving at ``rate`` per second (0: none)."""

    seconds: float
    context: int = 0
    rate: float = 0.0
    seed: int = 0
    high_priority: bool = False


class Alone(msgspec.Struct, frozen=True, tag_field="cmd", tag="alone"):
    """``reps`` pulls of ``context`` tokens one after another, no decode steps: the request's own time."""

    context: int
    reps: int


class Quit(msgspec.Struct, frozen=True, tag_field="cmd", tag="quit"):
    pass


Command = RunPhase | Alone | Quit


class PullRecord(msgspec.Struct):
    arrival: float  # host monotonic seconds: the Poisson arrival (the prefill's pages were asked for then)
    sent: float  # the Pull left at this step boundary
    done: float  # the Done arrived (0: none)
    ok: bool
    reason: str
    timings: dict[str, float]  # the daemon's per-stage seconds


class Verified(msgspec.Struct):
    requests: int
    layers: list[int]
    mismatches: int
    first: list[str]
    error: str = ""


class PhaseReply(msgspec.Struct):
    steps: list[tuple[float, float]]
    pulls: list[PullRecord]
    unanswered: int  # pulls without an answer by the timeout
    sent_late: int  # arrivals still waiting for a free pull slot when the phase ended (pulled after it)
    not_sent: int  # of those, never sent by the timeout
    emulator_errors: list[str]
    emulator_full: int  # attempts that waited for the emulator's blocks (held by requests in flight)
    verified: Verified | None


class Ready(msgspec.Struct):
    ready: bool
    num_blocks: int
    attention_rel_err: float
    kv_bytes_per_step: int
    registered: bool
    reason: str


class _Arrivals(threading.Thread):
    """Finishes a prefill at the emulator at each arrival time and queues (arrival, reply)."""

    def __init__(self, control: str, offsets: list[float], t0: float, tokens: int, out: queue.Queue) -> None:
        super().__init__(daemon=True)
        self.control, self.offsets, self.t0, self.tokens, self.out = control, offsets, t0, tokens, out
        self.errors: list[str] = []
        self.full = 0  # new-request attempts refused because the emulator's pool was full
        self.stop = threading.Event()

    def run(self) -> None:
        from sidecar.standins.emulator_control import ControlError, EmulatorClient

        client = EmulatorClient(self.control)
        try:
            for off in self.offsets:
                if self.stop.wait(max(0.0, self.t0 + off - time.monotonic())):
                    return
                reply = None
                while reply is None and not self.stop.is_set():
                    try:
                        reply = client.new_request(num_tokens=self.tokens)
                    except ControlError as exc:
                        if exc.field != "num_blocks":
                            raise
                        self.full += 1  # its blocks are still held by requests in flight: wait, as a prefill
                        self.stop.wait(0.002)
                if reply is not None:
                    self.out.put((self.t0 + off, reply))
        except Exception as exc:  # noqa: BLE001 - reported with the phase
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()


class ShimDecoder:
    """The decode loop, the pull slots and the shim's worker half of one process."""

    def __init__(self, cfg: DecoderConfig) -> None:
        import torch

        from sidecar.bench.decode_step import DecodeStep, kv_bytes_per_step
        from sidecar.standins.decoder import DecoderStandin, StandinShape

        self.cfg = cfg
        dev = torch.device(cfg.device)
        self.cuda = dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(dev)
        s = self.s = shape_of(cfg.tiny)
        rng = np.random.default_rng(cfg.seed)
        lens = rng.integers(cfg.context_min, cfg.context_max + 1, size=cfg.batch)
        pages = [-(-int(n) // s.block_size) for n in lens]
        self.slot_blocks = -(-cfg.max_context // s.block_size)
        # block 0: vLLM's null block; one slot more for the request kept until its bit-exact check
        nb = 1 + sum(pages) + (cfg.pull_slots + 1) * self.slot_blocks
        self.shape = StandinShape(layers=s.layers, heads=s.kv_heads, head_size=s.head_size,
                                  block_size=s.block_size, num_blocks=nb, dtype="bfloat16")
        self.standin = DecoderStandin(cfg.socket, self.shape, compat_factors=dict(cfg.compat_factors),
                                      pull_timeout_s=cfg.timeout_s, register_timeout_s=120.0, seed=cfg.seed,
                                      device=cfg.device)
        raw = self.standin.buffer.tensor
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        chunk = 1 << 28
        # Every page random and finite (random bf16 bits would hold NaNs and make the attention check NaN).
        for lo in range(0, raw.numel() // 2, chunk):
            raw.view(torch.bfloat16)[lo : lo + chunk].normal_(generator=gen)
        tables = torch.zeros((cfg.batch, max(pages)), dtype=torch.int32)
        for b, n in enumerate(pages):  # the running requests' pages, scattered as vLLM's free queue has them
            tables[b, :n] = torch.tensor(self.standin.allocate(n), dtype=torch.int32)
        self.step = DecodeStep(s, [self.standin.k_plane(i) for i in range(s.layers)],
                               [self.standin.v_plane(i) for i in range(s.layers)], tables,
                               torch.from_numpy(lens.astype(np.int32)), seed=cfg.seed)
        self.err = self.step.check_attention() if self.cuda else 0.0
        self.step.capture()
        self.kv_bytes = kv_bytes_per_step(s, lens)
        self.streams: dict[bool, Any] = {False: torch.cuda.Stream(dev) if self.cuda else None}
        if self.cuda:
            self.streams[True] = torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1])
        self.clock = Clock(self.cuda)
        self.registered = self.standin.register()
        self._ids = 0

    def ready(self) -> Ready:
        client = self.standin.worker.client
        return Ready(ready=True, num_blocks=self.shape.num_blocks, attention_rel_err=self.err,
                     kv_bytes_per_step=self.kv_bytes, registered=self.registered,
                     reason="" if self.registered or client is None else client.status_reason)

    # ------------------------------------------------------------------------------------------ pulls

    def _send(self, reply: Any) -> tuple[str, list[int], float]:
        """Send one Pull; (request id, its local blocks, when it was handed to the connector). The time is
        taken before the send: the shim's receiver may stamp the Done before ``pull`` returns."""
        from vllm_glue.orders import PullOrder, parse_remote

        self._ids += 1
        rid = f"interf-{self._ids}"
        local = self.standin.allocate(len(reply.kernel_block_ids))
        sent = time.monotonic()
        self.standin.pull([PullOrder(rid, parse_remote(reply.kv_transfer_params), local, True,
                                     time.monotonic_ns())])
        return rid, local, sent

    def _collect(self) -> list[Any]:
        """The outcomes that arrived (the connector's get_finished, without blocking)."""
        w = self.standin.worker
        w.transfer_results()
        w.load_errors()
        out = list(w.tracker.outcomes)
        w.tracker.outcomes.clear()
        return out

    def run_phase(self, cmd: RunPhase) -> PhaseReply:
        import torch

        offsets = st.poisson_arrivals(cmd.rate, cmd.seconds, np.random.default_rng(cmd.seed))
        arrived: queue.Queue = queue.Queue()
        waiting: list[tuple[float, Any]] = []
        inflight: dict[str, tuple[float, float, Any, list[int]]] = {}
        records: list[PullRecord] = []
        first: tuple[Any, list[int]] | None = None
        keep: list[int] = []
        free_slots = self.cfg.pull_slots
        stream = self.streams[cmd.high_priority]
        self.clock.anchor()
        t0 = time.monotonic()
        feeder = _Arrivals(self.cfg.emulator_control, offsets, t0, cmd.context, arrived)
        if offsets:
            feeder.start()
        marks = []

        def answered() -> None:
            nonlocal free_slots, first
            for o in self._collect():
                if o.req_id not in inflight:
                    continue  # a late answer to an earlier phase's pull (counted unanswered there)
                arrival, sent, reply, local = inflight.pop(o.req_id)
                records.append(PullRecord(arrival=arrival, sent=sent, done=o.received_at, ok=o.ok,
                                          reason=o.reason or "", timings=dict(o.timings)))
                if o.ok and first is None:
                    first = (reply, local)  # kept until checked: nothing else is pulled into its blocks
                    keep.extend(local)
                else:
                    self.standin.release(local)
                free_slots += 1

        def boundary() -> None:
            nonlocal free_slots
            answered()
            while True:
                try:
                    waiting.append(arrived.get_nowait())
                except queue.Empty:
                    break
            while waiting and free_slots > 0:
                arrival, reply = waiting.pop(0)
                rid, local, sent = self._send(reply)
                inflight[rid] = (arrival, sent, reply, local)
                free_slots -= 1

        end = t0 + cmd.seconds
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            while time.monotonic() < end:
                boundary()
                a = self.clock.mark(stream)
                self.step()
                b = self.clock.mark(stream)
                if self.cuda:
                    b.synchronize()  # a decoder samples each step's token on the host before the next
                marks.append((a, b))
        feeder.stop.set()
        if offsets:
            feeder.join(timeout=5)
        late = len(waiting) + arrived.qsize()
        deadline = time.monotonic() + self.cfg.timeout_s
        # requests that arrived but found no free slot are still pulled (their prefill holds its blocks until
        # read), after the phase; then every answer
        while (inflight or waiting or not arrived.empty()) and time.monotonic() < deadline:
            boundary()
            time.sleep(0.001)
        unanswered, not_sent = len(inflight), len(waiting) + arrived.qsize()
        steps = [(self.clock.seconds(a), self.clock.seconds(b)) for a, b in marks]
        verified = self._verify(first) if first is not None else None
        if keep:
            self.standin.release(keep)
        # unanswered pulls keep their blocks: the daemon may still write them
        return PhaseReply(steps=steps, pulls=sorted(records, key=lambda r: r.arrival), unanswered=unanswered,
                          sent_late=late, not_sent=not_sent, emulator_errors=feeder.errors[:5],
                          emulator_full=feeder.full, verified=verified)

    def _verify(self, first: tuple[Any, list[int]]) -> Verified:
        """The first answered request of a phase, bit for bit against the emulator's pages converted by the
        torch reference (a check that cannot run is reported, never passed)."""
        from sidecar.bench.e2e_roles import mismatched_planes, spread

        reply, local = first
        layers = spread(self.s.layers, self.cfg.verify_layers)
        try:
            bad = mismatched_planes(self.standin, reply.kernel_block_ids, reply.block_generations, local,
                                    self.cfg.emulator_seed, self.shape.remote_fmt, layers)
        except Exception as exc:  # noqa: BLE001
            return Verified(requests=0, layers=layers, mismatches=-1, first=[],
                            error=f"{type(exc).__name__}: {exc}")
        return Verified(requests=1, layers=layers, mismatches=len(bad), first=bad[:5])

    def alone(self, cmd: Alone) -> PhaseReply:
        """Pulls one at a time with the decoder idle: each request's own Pull->Done."""
        from sidecar.standins.emulator_control import EmulatorClient

        client = EmulatorClient(self.cfg.emulator_control)
        records: list[PullRecord] = []
        unanswered = 0
        try:
            for _ in range(cmd.reps):
                reply = client.new_request(num_tokens=cmd.context)
                arrival = time.monotonic()
                rid, local, sent = self._send(reply)
                got = self.standin.wait({rid}, self.cfg.timeout_s, poll_s=0.0005)
                o = got.get(rid)
                if o is None:
                    unanswered += 1
                    continue  # its blocks stay taken
                records.append(PullRecord(arrival=arrival, sent=sent, done=o.received_at, ok=o.ok,
                                          reason=o.reason or "", timings=dict(o.timings)))
                self.standin.release(local)
        finally:
            client.close()
        return PhaseReply(steps=[], pulls=records, unanswered=unanswered, sent_late=0, not_sent=0,
                          emulator_errors=[], emulator_full=0, verified=None)

    def close(self) -> None:
        self.standin.close()


_COMMAND = msgspec.json.Decoder(Command)


def main() -> None:
    """Config as the first stdin line, then one command a line; replies as ``@@`` JSON lines."""
    import logging
    import sys

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = msgspec.convert(_read(), DecoderConfig)
    if cfg.device == "cpu":
        import torch

        torch.set_num_threads(1)  # the daemon, the emulator and this process share the CI's few cores
    dec = ShimDecoder(cfg)
    try:
        _say(dec.ready())
        for line in sys.stdin:
            cmd = _COMMAND.decode(line)
            if isinstance(cmd, Quit):
                return
            _say(dec.run_phase(cmd) if isinstance(cmd, RunPhase) else dec.alone(cmd))
    finally:
        dec.close()


if __name__ == "__main__":
    main()
