"""The registered caches' lifecycle against pulls in flight, on ``FakePort`` with real shared memory: a
registration replaced, unregistered or orphaned while pulls are at every stage. The caches are painted with
a canary (every element different: the in-place conversion only moves elements around, so it changes a
uniform paint not at all); an unchanged canary proves nothing wrote."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from sidecar.wire import ipc
from sidecar.wire import protocol as p
from tests.sidecar.daemon.test_logic import LAYERS, PLANE, B, Harness, run, started


def _canary(nbytes: int) -> torch.Tensor:
    return torch.arange(nbytes // 2, dtype=torch.int32).to(torch.int16)


def _painted(nbytes: int) -> ipc.ShmBuffer:
    shm = ipc.create_shm_buffer(nbytes)
    shm.tensor.view(torch.int16).copy_(_canary(nbytes))
    return shm


def _untouched(shm: ipc.ShmBuffer) -> bool:
    return torch.equal(shm.tensor.view(torch.int16), _canary(shm.tensor.numel()))


def _register(h: Harness, shm: ipc.ShmBuffer) -> p.RegisterCaches:
    """The harness's RegisterCaches with ``shm`` as its buffer (the same layout, other memory)."""
    return msgspec.structs.replace(h.register_message(), buffers=[shm.description])


@pytest.mark.parametrize("who", [b"shim", b"shim2"])
def test_a_pull_accepted_for_replaced_caches_never_converts_into_the_new_ones(who):
    """The owner's Pull taken off its socket while a RegisterCaches replaces its caches (here: in the loop
    turn the replaced registration's last pull ended, after that registration's pulls were cancelled) was
    accepted against the old caches, but its first step found the new ones current and converted into
    them: old block ids in new buffers (the owner registered again), or in another shim's caches."""

    async def main():
        async with started() as h:
            h.port.handshake_gate = asyncio.Event()
            h.pull("a")
            await h.until_stage("a", "handshake")
            new = _painted(LAYERS * 2 * B * PLANE * 2)
            try:
                h.sent.clear()
                loop = asyncio.get_running_loop()
                h.daemon.jobs.get("a").task.add_done_callback(lambda _t: loop.call_soon(h.pull, "late"))
                if who != b"shim":
                    h.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="t"), who=who)
                h.send(_register(h, new), who=who)
                registered = await h.reply(p.Registered)
                assert not (await h.reply(p.Done, "a")).ok
                h.port.handshake_gate.set()
                late = await h.reply(p.Done, "late")
                assert h.daemon.caches.current.generation == registered.generation
                assert _untouched(new), "a pull accepted for the old caches converted into the new ones"
                assert not late.ok, late
            finally:
                h.port.handshake_gate.set()
                new.close()

    run(main())
