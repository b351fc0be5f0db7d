"""The mapped read mode in the daemon's logic, on ``FakePort`` (its ``mapped`` tensor stands for the prefill's
mapped pages, in this process's memory): the conversion reads the request's remote blocks straight from it,
the prefill is told only after the conversion ended (also when aborted during it), blocks outside the
request stay as they were, and a prefill whose pages do not map is read the usual way."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import torch

from sidecar.convert import convert_standard_to_shuffled
from sidecar.wire import protocol as p
from tests.sidecar.daemon.test_logic import LAYERS, PLANE, B, D, H, Harness, N, blocked_conversion, run
from tests.sidecar.daemon.test_logic_tp import until

__all__ = ["blocked_conversion"]  # a fixture, used by name

REMOTE_BLOCKS = 12
CANARY = 0x5A5A


def _mapped_pages(seed: int = 7) -> torch.Tensor:
    """The prefill's standard pages, [layers, blocks, 2 * PLANE] bf16 bit patterns."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (LAYERS, REMOTE_BLOCKS, 2 * PLANE), generator=g, dtype=torch.int16)
    return bits.view(torch.bfloat16)


def _planes(h: Harness) -> torch.Tensor:
    """The decoder's caches as int16 [layers, K/V, blocks, PLANE] (the harness's layout)."""
    return h.shm.tensor.view(torch.int16).view(LAYERS, 2, B, PLANE)


@contextlib.asynccontextmanager
async def mapped_started(maps: bool = True, **overrides):
    """A started Harness in pull_mode mapped whose fake prefill's pages map (``_mapped_pages``) unless
    ``maps`` is False, every plane painted with the canary; stopped on the way out."""
    h = Harness(pull_mode="mapped", **overrides)
    h.port.mapped = _mapped_pages() if maps else None
    await h.start()
    _planes(h).fill_(CANARY)
    try:
        yield h
    finally:
        await h.stop()


def _expected(pages: torch.Tensor, layer: int, remote: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    m = len(remote)
    k = torch.zeros(m, PLANE, dtype=torch.bfloat16)
    v = torch.zeros(m, PLANE, dtype=torch.bfloat16)
    convert_standard_to_shuffled(
        k, v, torch.arange(m), num_heads=H, block_size=N, head_size=D, src=pages[layer, remote].contiguous()
    )
    return k.view(torch.int16), v.view(torch.int16)


def test_a_mapped_pull_converts_the_remote_blocks_and_touches_nothing_else():
    async def main():
        async with mapped_started() as h:
            local, remote = [1, 4, 6], [9, 0, 5]
            h.pull("a", local, remote=remote)
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            assert h.port.reads == []  # no NIXL read at all
            await until(lambda: h.port.notified == ["r-a"])  # told once, after the conversion
            assert h.port.map_calls == ["kv-sidecar-post_0"]  # mapped on the poster thread (its context)
            # unmapping waits for the conversion stream's fence (None on the CPU twin), not the whole device
            assert h.port.fences == [h.daemon.conversions.fence] and h.port.fences[0]() is None
            planes = _planes(h)
            for layer in range(LAYERS):
                k, v = _expected(h.port.mapped, layer, remote)
                assert torch.equal(planes[layer, 0, local], k)
                assert torch.equal(planes[layer, 1, local], v)
            others = [b for b in range(B) if b not in local]
            assert (planes[:, :, others] == CANARY).all()  # nothing outside the request's blocks
            m = h.daemon.metrics
            assert m.read_modes.labels(mode="mapped")._value.get() == 1
            assert m.peer_mappings.labels(outcome="mapped")._value.get() == 1
            assert m.bytes_pulled._value.get() == LAYERS * len(local) * 2 * PLANE * 2
            h.pull("b", [2], remote=[3])  # the peer's mapping is asked for once
            assert (await h.reply(p.Done, "b")).ok
            assert h.port.map_calls == ["kv-sidecar-post_0"]

    run(main())


def test_an_abort_during_a_mapped_conversion_notifies_only_after_it_ended(blocked_conversion):
    gate, started_ = blocked_conversion

    async def main():
        async with mapped_started() as h:
            h.pull("a", [1, 2], remote=[3, 4])
            while not started_.is_set():
                await asyncio.sleep(0.002)
            h.send(p.Abort(req_id="a"))
            await asyncio.sleep(0.05)
            # the kernel still reads the prefill's blocks: no notification, no answer yet
            assert h.port.notified == [] and h.answers("a") == []
            gate.set()
            aborted = await h.reply(p.Aborted, "a")
            assert aborted.safe
            await until(lambda: h.port.notified == ["r-a"])  # right after the answer (a loop turn later)

    run(main())


def test_a_prefill_whose_pages_do_not_map_is_read_the_usual_way():
    async def main():
        async with mapped_started(maps=False) as h:
            for req in ("a", "b"):
                h.pull(req, [1, 2], remote=[3, 4])
                assert (await h.reply(p.Done, req)).ok
            assert [r.mode for r in h.port.reads] == ["direct", "direct"]  # no staging pool: direct
            assert len(h.port.map_calls) == 1  # the refusal is remembered for the peer
            m = h.daemon.metrics
            assert m.peer_mappings.labels(outcome="unavailable")._value.get() == 1
            assert m.read_modes.labels(mode="direct")._value.get() == 2
            assert h.port.notified == ["r-a", "r-b"]

    run(main())


def test_a_mapped_pull_with_remote_ids_beyond_the_mapping_fails_and_writes_nothing():
    async def main():
        async with mapped_started() as h:
            h.port.mapped = h.port.mapped[:, :4]  # the prefill's region holds 4 blocks; block 9 is not in it
            h.pull("a", [1, 2], remote=[2, 9])
            done = await h.reply(p.Done, "a")
            assert not done.ok and "convert" in done.reason, done
            assert (_planes(h) == CANARY).all()
            await until(lambda: h.port.notified == ["r-a"])

    run(main())


def test_the_remote_ids_are_the_source_rows(monkeypatch):
    """The conversion gets the request's remote block ids as source rows of the whole mapping."""
    from sidecar.daemon import conversion as conversion_mod

    seen = []
    real = conversion_mod.convert_blocks

    def record(caches, block_ids, fmt, src, layers=None, limits=None, planes=None, src_index=None):
        seen.append(
            (np.asarray(block_ids).tolist(), tuple(src.shape), np.asarray(src_index).tolist(), layers)
        )
        return real(caches, block_ids, fmt, src, layers, limits, planes, src_index)

    monkeypatch.setattr(conversion_mod, "convert_blocks", record)

    async def main():
        async with mapped_started() as h:
            h.pull("a", [5, 3], remote=[11, 2])
            assert (await h.reply(p.Done, "a")).ok
            assert seen == [([5, 3], (LAYERS, REMOTE_BLOCKS, 2 * PLANE), [11, 2], (0, LAYERS))]

    run(main())


def test_pulls_arriving_together_map_their_prefill_once():
    async def main():
        async with mapped_started() as h:
            for i, req in enumerate("abcd"):
                h.pull(req, [i + 1], remote=[i])
            for req in "abcd":
                assert (await h.reply(p.Done, req)).ok
            assert h.port.map_calls == ["kv-sidecar-post_0"]
            assert h.daemon.metrics.peer_mappings.labels(outcome="mapped")._value.get() == 1

    run(main())


def test_a_prefill_without_pulls_for_mapping_idle_s_is_let_go_and_mapped_again_later():
    async def main():
        async with mapped_started(mapping_idle_s=30.0) as h:
            h.pull("a", [1], remote=[2])
            assert (await h.reply(p.Done, "a")).ok
            mapped, m = h.daemon.mapped, h.daemon.metrics
            assert m.mapped_peers._value.get() == 1
            now = time.monotonic()
            assert mapped.release_idle(now + 29) == 0  # used within mapping_idle_s: kept
            assert mapped.release_idle(now + 31) == 1
            await asyncio.sleep(0.02)  # unmapped on the poster thread
            assert h.port.unmapped == h.port.peers[:1] and m.mapped_peers._value.get() == 0
            h.pull("b", [3], remote=[4])
            assert (await h.reply(p.Done, "b")).ok
            assert len(h.port.map_calls) == 2 and m.mapped_peers._value.get() == 1

    run(main())


def test_an_unmappable_prefill_is_not_asked_again_nor_unmapped_after_mapping_idle_s():
    """The port remembers a refusal for the peer's life (a restarted prefill is a new peer), so asking again
    would only count it twice."""

    async def main():
        async with mapped_started(maps=False, mapping_idle_s=30.0) as h:
            h.pull("a", [1], remote=[2])
            assert (await h.reply(p.Done, "a")).ok
            assert h.daemon.mapped.release_idle(time.monotonic() + 31) == 0
            h.pull("b", [3], remote=[4])
            assert (await h.reply(p.Done, "b")).ok
            assert len(h.port.map_calls) == 1 and h.port.unmapped == []
            assert h.daemon.metrics.peer_mappings.labels(outcome="unavailable")._value.get() == 1

    run(main())


def test_a_pull_from_an_admitted_prefill_starts_its_conversion_in_its_first_step(blocked_conversion):
    """Once the prefill is admitted and mapped, a Pull's job goes from its first step to its conversion
    without another loop turn: none for a handshake that is already through."""
    gate, started_ = blocked_conversion

    async def main():
        async with mapped_started() as h:
            gate.set()
            h.pull("a", [1], remote=[2])  # handshakes and maps the prefill
            assert (await h.reply(p.Done, "a")).ok
            gate.clear()
            started_.clear()
            h.pull("b", [3], remote=[4])
            await asyncio.sleep(0)  # the job's first step
            assert h.job_stage("b") == "convert"
            assert "handshake" in h.daemon.jobs.get("b").timings  # went through it, without a wait
            gate.set()
            assert (await h.reply(p.Done, "b")).ok

    run(main())


def test_a_mapped_pull_through_a_prefill_nixl_let_go_fails_and_writes_nothing():
    """A newer registration (or a restarted prefill at the same address) unloads the peer on the poster
    thread; until the loop forgets its entry a Pull may still get it. Its mapping stays open for conversions
    launched before, but a new one must not read through it: the old regions may now hold the newer
    registration's pages (a direct read through it is refused alike). Before, it was converted from."""

    async def main():
        async with mapped_started() as h:
            h.pull("a", [1], remote=[2])
            assert (await h.reply(p.Done, "a")).ok
            _planes(h).fill_(CANARY)
            h.port.peers[0].unloaded = True  # as NixlTransfer.add_peer of the newer admission does
            h.pull("b", [3, 4], remote=[5, 6])
            done = await h.reply(p.Done, "b")
            assert not done.ok and "re-registered or restarted" in done.reason, done
            assert (_planes(h) == CANARY).all()
            await until(lambda: h.port.notified == ["r-a", "r-b"])  # still told to free the blocks

    run(main())


def test_a_prefill_let_go_while_it_was_being_mapped_is_not_converted_from():
    """The newer admission's load ran on the poster thread while this pull waited for the first mapping."""

    async def main():
        async with mapped_started() as h:
            real = h.port.map_pages

            def map_then_unload(peer, dtype, fence=None):
                got = real(peer, dtype, fence)
                peer.unloaded = True
                return got

            h.port.map_pages = map_then_unload
            h.pull("a", [1, 2], remote=[3, 4])
            done = await h.reply(p.Done, "a")
            assert not done.ok and "re-registered or restarted" in done.reason, done
            assert (_planes(h) == CANARY).all()
            await until(lambda: h.port.notified == ["r-a"])

    run(main())


def test_a_mapping_is_not_let_go_before_the_pull_that_waited_for_it_has_launched():
    """The first pull to a prefill waits for its mapping, stamped used when it asked. A mapping that took
    longer than mapping_idle_s (the poster thread busy with long posts) ends idle by that stamp, and the
    pull resumes a loop turn or two after it ended: a release pass between the two let it go, its unmap
    queued, while that pull went on to convert through it. Now it is kept until the pull has launched."""

    async def main():
        async with mapped_started(mapping_idle_s=30.0) as h:
            gate, real, released = threading.Event(), h.port.map_pages, []

            def slow_map(peer, dtype, fence=None):
                gate.wait(5)
                return real(peer, dtype, fence)

            h.port.map_pages = slow_map
            h.pull("a", [1, 2], remote=[3, 4])
            mapped = h.daemon.mapped
            await until(lambda: len(mapped._sources) == 1)
            found = next(iter(mapped._sources.values()))
            # a release pass right after the mapping ended, once it is idle by the pull's stamp
            found.add_done_callback(lambda _f: released.append(mapped.release_idle(time.monotonic() + 31)))
            gate.set()
            done = await h.reply(p.Done, "a")
            assert done.ok, done
            assert released == [0] and h.port.unmapped == []
            assert h.daemon.metrics.mapped_peers._value.get() == 1
            assert mapped.release_idle(time.monotonic() + 31) == 1  # idle afterwards: let go as before

    run(main())
