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


@pytest.mark.parametrize("how", ["unregister", "register", "shim gone"])
def test_a_pull_arriving_while_the_caches_are_let_go_neither_holds_them_nor_writes(how):
    """A Pull of the owner taken off its socket after the registration change had cancelled the pulls in
    flight (here: in the turn the last of them ended, before the change resumed) took the caches being let
    go, was never cancelled, and the change waited for it: the pull converted into caches the shim had
    asked to let go, and Unregistered (Registered, the release of a vanished shim's caches) waited out its
    whole deadline, past the shim's own register timeout."""

    async def main():
        async with started(owner_grace_s=0.05) as h:
            old = _canary(h.shm.tensor.numel() * h.shm.tensor.element_size())
            h.shm.tensor.view(torch.int16).copy_(old)
            new = _painted(LAYERS * 2 * B * PLANE * 2)
            try:
                h.port.handshake_gate = asyncio.Event()
                h.pull("a")
                await h.until_stage("a", "handshake")
                h.sent.clear()
                h.daemon.jobs.get("a").task.add_done_callback(lambda _t: h.pull("late", timeout_s=3.0))
                if how == "unregister":
                    h.send(p.Unregister())
                    await h.reply(p.Unregistered, timeout=1.0)
                elif how == "register":
                    h.send(_register(h, new))
                    await h.reply(p.Registered, timeout=1.0)
                else:
                    h.daemon.registrations.shim_gone(b"shim")
                    await h.reply(p.Done, "a")
                    deadline = asyncio.get_running_loop().time() + 1.0
                    while h.daemon.caches.current is not None or h.port.registrations:
                        assert asyncio.get_running_loop().time() < deadline, "the caches were not released"
                        await asyncio.sleep(0.005)
                h.port.handshake_gate.set()
                late = await h.reply(p.Done, "late")
                assert not late.ok, late
                assert torch.equal(h.shm.tensor.view(torch.int16), old), "written while let go"
                assert _untouched(new)
            finally:
                h.port.handshake_gate.set()
                new.close()

    run(main())


def test_a_refused_registration_does_not_keep_a_vanished_shims_caches():
    """The owner's completion socket closed (its decoder died): its caches are released after the grace.
    A RegisterCaches that is then refused (here another shim's, naming a file that is not there) replaced
    nothing, but it had called the release off: the dead decoder's caches stayed mapped and registered with
    NIXL until some later registration replaced them."""

    async def main():
        async with started(owner_grace_s=0.1) as h:
            h.daemon.registrations.shim_gone(b"shim")
            h.send(p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="t"), who=b"shim2")
            gone = msgspec.structs.replace(h.shm.description.shm, path="/dev/shm/kv-sidecar-test-not-there")
            buffer = msgspec.structs.replace(h.shm.description, shm=gone)
            h.send(msgspec.structs.replace(h.register_message(), buffers=[buffer]), who=b"shim2")
            err = await h.reply(p.Error)
            assert err.in_reply_to == "RegisterCaches" and err.reason.startswith("shm.path"), err
            deadline = asyncio.get_running_loop().time() + 1.0
            while h.daemon.caches.current is not None or h.port.registrations:
                assert asyncio.get_running_loop().time() < deadline, "the vanished shim's caches were kept"
                await asyncio.sleep(0.005)

    run(main())
