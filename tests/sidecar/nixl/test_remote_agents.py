"""Remote agents loaded and let go, on real NIXL (UCX on host memory) against the prefill emulator. NIXL
loads one remote agent per name and does not count the loads: loading the same metadata again returns the
same name, and one removal unloads it for every peer and notify-only load that shares it. Each test makes its
own agent, so no peer another test left loaded shares the emulator's agent."""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
import numpy as np
import pytest

from sidecar.daemon.port import Admission, PeerTarget
from sidecar.nixl.agent import NixlTransfer
from sidecar.nixl.errors import PeerConflict, RemoteRefused, TransferFailed
from sidecar.nixl.port import NixlPort
from sidecar.wire import prefill as wire
from tests.sidecar.nixl.test_agent import (
    LAYERS,
    RULES,
    SETTINGS,
    SHUF,
    ShmPlanes,
    _spawn,
    _stop,
    address,
    check_planes,
    connect,
    local_factors,
    new_request,
)


@pytest.fixture(scope="module")
def emu():
    e = _spawn("--num-blocks", "64")
    yield e
    _stop(e)


class nixlBackendError(Exception):  # noqa: N801 - named as NIXL's own are (``map_nixl_error`` maps by name)
    pass


class ConnectionFails:
    """NIXL's agent, real but for ``make_connection``, which fails (the prefill unreachable); the names of the
    remote agents it loaded in ``loaded``."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.loaded: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def add_remote_agent(self, metadata: bytes):
        name = self._agent.add_remote_agent(metadata)
        self.loaded.append(name.decode() if isinstance(name, bytes) else str(name))
        return name

    def make_connection(self, name: str) -> None:
        raise nixlBackendError(f"cannot reach {name}")


@pytest.fixture
def fresh():
    t = NixlTransfer(SETTINGS)
    yield t
    t.close()


def _target(e) -> PeerTarget:
    ready = e.ready
    return PeerTarget(ready.engine_id, 0, ready.side_channel_host, ready.side_channel_port, generation=1)


def test_a_prefill_admitted_again_after_a_refusal_reads_through_the_agent_its_peer_shares(emu):
    """A pull holds the prefill's admission; a reload's rules refuse it (loaded again, only to be notified:
    the same NIXL agent), and the next reload admits it again. Letting the notify-only load go must not unload
    the agent the held peer, and the new one sharing it, read through: before, the new peer's first pull
    failed (``prep remote dlist: not found``)."""
    port = NixlPort(SETTINGS)
    planes = ShmPlanes()
    try:
        reg = port.register([(planes.base, planes.arr.nbytes, 0)], "DRAM")
        dest = port.destination(reg, planes.planes())
        admit = Admission(local_format=SHUF, layers=LAYERS, compat_factors=local_factors(emu),
                          rules=RULES.remote_formats)
        held = asyncio.run(port.connect(_target(emu), admit))  # a pull reads through it
        with pytest.raises(RemoteRefused) as refused:
            asyncio.run(port.connect(_target(emu), msgspec.structs.replace(admit, conversion_enabled=False)))
        assert refused.value.peer.agent_name == held.agent_name  # NIXL loaded the same agent again
        again = asyncio.run(port.connect(_target(emu), admit))
        assert again is not held and again.agent_name == held.agent_name
        reply, params = new_request(emu, 4)
        rid = params.remote_request_id
        port.agent.wait(port.agent.pull(again, dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid))
        check_planes(planes.arr, reply, [0, 1, 2, 3])
        port.remove_peer(held)
        port.remove_peer(again)
        port.deregister(reg)
    finally:
        port.close()
        planes.close()


def test_a_peer_let_go_leaves_a_notify_only_load_of_its_agent_loaded(emu, fresh):
    """A pull held the prefill's admission when a reload's rules refused it (loaded again to be notified: the
    same NIXL agent). When that pull lets go, removing its peer must leave the agent loaded for the
    notifications: before, each refused request's notification failed (``send_notif: not found``) and the
    prefill held its blocks until their lease ended."""
    held = connect(fresh, emu)
    told = fresh.load_notify_only(engine_id=held.engine_id, tp_rank=held.tp_rank, address=held.address,
                                  agent_metadata=held.agent_metadata)
    name = told.agent_name
    assert name == held.agent_name
    fresh.remove_peer(held)
    _, params = new_request(emu, 2)
    rid = params.remote_request_id
    fresh.notify_agent(name, rid)
    assert emu.client.wait_state(rid, "freed_by_notif", 10).notif_counts == [1]
    assert fresh.let_go_notify_only(0.0) == 1  # the notify-only load let go: now NIXL unloads it
    assert not fresh.agent.check_remote_metadata(name)


def test_a_failed_connection_unloads_the_agent_it_loaded(emu, fresh, monkeypatch):
    """``make_connection`` fails after NIXL loaded the prefill's agent: no peer records the agent, so it is
    let go at once, not left loaded until the agent closes (one per prefill agent never connected). The next
    handshake loads it again (NIXL would take it loaded, too: nothing was stuck, only leaked) and connects."""
    failing = ConnectionFails(fresh.remote_peers.agent)
    monkeypatch.setattr(fresh.remote_peers, "agent", failing)
    with pytest.raises(TransferFailed):
        connect(fresh, emu)
    monkeypatch.undo()
    [name] = failing.loaded
    assert fresh.peer(emu.ready.engine_id, 0) is None
    assert not fresh.agent.check_remote_metadata(name)
    peer = connect(fresh, emu)
    assert peer.agent_name == name and fresh.agent.check_remote_metadata(name)
    _, params = new_request(emu, 2)
    rid = params.remote_request_id
    fresh.notify(peer, rid)
    assert emu.client.wait_state(rid, "freed_by_notif", 10).notif_counts == [1]


def test_a_newer_generation_of_unchanged_metadata_shares_the_loaded_agent(emu, fresh, monkeypatch):
    """A newer registration generation whose rank's agent metadata did not change: the peer it replaces is
    unloaded (reads through it refused), and the new one reads through the agent already loaded. Before, the
    old peer's agent was removed first and loaded again: were the load or connection then to fail (here
    ``make_connection``), the rank was left with neither peer, the old one's pulls failing with it."""
    planes = ShmPlanes()
    try:
        reg = fresh.register([(planes.base, planes.arr.nbytes, 0)], "DRAM")
        dest = fresh.destination(reg, planes.planes())
        old = connect(fresh, emu)  # generation 1
        failing = ConnectionFails(fresh.remote_peers.agent)
        monkeypatch.setattr(fresh.remote_peers, "agent", failing)
        newer = fresh.add_peer(engine_id=emu.ready.engine_id, tp_rank=0, generation=2, address=address(emu),
                               agent_metadata=old.agent_metadata, plan=old.plan, regions=old.regions)
        monkeypatch.undo()
        assert failing.loaded == [] and newer.agent_name == old.agent_name
        assert old.unloaded and fresh.peer(emu.ready.engine_id, 0) is newer
        reply, params = new_request(emu, 4)
        rid = params.remote_request_id
        fresh.wait(fresh.pull(newer, dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid))
        check_planes(planes.arr, reply, [0, 1, 2, 3])
        fresh.remove_peer(old)  # its pull let go: the agent stays for the newer peer
        assert fresh.agent.check_remote_metadata(newer.agent_name)
        fresh.remove_peer(newer)
        assert not fresh.agent.check_remote_metadata(newer.agent_name)
        fresh.deregister(reg)
    finally:
        planes.close()


def test_nixl_loads_other_metadata_over_a_loaded_name_and_keeps_its_regions():
    """Why ``add_peer`` unloads what an admission of other metadata replaces before loading it: a prefill
    that registers again keeps its agent's name, and NIXL loads the new metadata over the old one's regions,
    keeping each region it holds as first loaded (nixlRemoteSection::addDescList skips those it has): a region
    the prefill let go stays readable until the agent is removed."""
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(backends=["UCX"])
    prefill = nixl_agent(f"prefill-{uuid.uuid4()}", conf)
    decoder = nixl_agent(f"decoder-{uuid.uuid4()}", conf)
    first, second = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    reg = prefill.register_memory([(first.ctypes.data, first.nbytes, 0, "")], "DRAM")
    before = prefill.get_agent_metadata()
    prefill.deregister_memory(reg)
    reg = prefill.register_memory([(second.ctypes.data, second.nbytes, 0, "")], "DRAM")
    after = prefill.get_agent_metadata()
    name = decoder.add_remote_agent(before)
    assert decoder.add_remote_agent(after) == name

    def prep(buf: np.ndarray) -> None:
        decoder.release_dlist_handle(
            decoder.prep_xfer_dlist(name, np.array([[buf.ctypes.data, 64, 0]], np.uint64), "DRAM")
        )

    prep(first)  # let go by the prefill, still there
    prep(second)
    decoder.remove_remote_agent(name)
    decoder.add_remote_agent(after)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        prep(first)
    prep(second)
    prefill.deregister_memory(reg)


@pytest.mark.parametrize("then", ["refused", "admitted"])
def test_a_notify_only_load_is_let_go_when_its_prefill_restarts(then):
    """A pull held the prefill's admission when a reload's rules refused it (a notify-only load of the same
    agent, kept loaded when the pull let go). The prefill then restarts at the same address (a new NIXL agent)
    and is refused again, or admitted: nothing will notify the old agent any more, so it is let go. Before, it
    stayed loaded (and recorded) until the daemon exited, one per restart of a refused prefill."""
    a = _spawn("--num-blocks", "64")
    port = NixlPort(SETTINGS)
    b = None
    try:
        admit = Admission(local_format=SHUF, layers=LAYERS, compat_factors=local_factors(a),
                          rules=RULES.remote_formats)
        refuse = msgspec.structs.replace(admit, conversion_enabled=False)
        held = asyncio.run(port.connect(_target(a), admit))
        with pytest.raises(RemoteRefused) as refused:
            asyncio.run(port.connect(_target(a), refuse))
        old = refused.value.peer.agent_name
        port.remove_peer(held)  # its pull let go: the notify-only load keeps the agent for notifications
        assert port.agent.agent.check_remote_metadata(old)
        side_channel = a.ready.side_channel_port
        _stop(a)
        b = _spawn("--num-blocks", "64", "--port", str(side_channel))  # restarted: same address
        if then == "refused":
            with pytest.raises(RemoteRefused) as again:
                asyncio.run(port.connect(_target(b), refuse))
            new = again.value.peer
        else:
            new = asyncio.run(port.connect(_target(b), admit))
        assert new.agent_name != old
        assert not port.agent.agent.check_remote_metadata(old)  # the old prefill's agent let go
        _, params = new_request(b, 2)
        port.notify(new, params.remote_request_id)  # the new one is notified
        assert b.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
        if then == "admitted":
            port.remove_peer(new)
    finally:
        port.close()
        _stop(a)
        if b is not None:
            _stop(b)


class Clock:
    """The port's clock, moved by hand: ``let_go_notify_only`` without waiting out a lease."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


IDLE_S = 32.0  # what the daemon passes: lease_s (30) and lease_margin_s (2)


def _refusing(e) -> tuple[Admission, Admission]:
    """The prefill's admission, and one the rules refuse it under (its agent then loaded only to notify)."""
    admit = Admission(local_format=SHUF, layers=LAYERS, compat_factors=local_factors(e),
                      rules=RULES.remote_formats)
    return admit, msgspec.structs.replace(admit, conversion_enabled=False)


def test_a_refused_prefill_gone_for_good_has_its_agent_let_go_after_the_lease():
    """A prefill the rules refuse (its agent loaded only to be notified) is told of a request, then scaled
    down for good: nothing can need its agent once its lease is over, so the lease tick lets it go. Before,
    it stayed loaded, a UCX endpoint to a dead process, until the daemon exited: one per refused prefill
    gone away."""
    a = _spawn("--num-blocks", "64")
    clock = Clock()
    port = NixlPort(SETTINGS, clock=clock)
    try:
        _, refuse = _refusing(a)
        with pytest.raises(RemoteRefused) as refused:
            asyncio.run(port.connect(_target(a), refuse))
        told = refused.value.peer
        _, params = new_request(a, 2)
        clock.t = 5.0
        port.notify(told, params.remote_request_id)
        assert a.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
        _stop(a)  # scaled down: never back at that address
        clock.t = 5.0 + IDLE_S  # its last use a lease and margin ago, not more
        assert port.let_go_notify_only(IDLE_S) == 0
        assert port.agent.agent.check_remote_metadata(told.agent_name)
        clock.t += 1.0
        assert port.let_go_notify_only(IDLE_S) == 1
        assert not port.agent.agent.check_remote_metadata(told.agent_name)
        assert port.let_go_notify_only(IDLE_S) == 0  # forgotten, not let go twice
    finally:
        port.close()
        _stop(a)


@pytest.mark.parametrize("use", ["refused again", "notified"])
def test_a_notify_only_load_used_within_the_lease_stays_loaded(emu, use):
    """A refused prefill refused again (the same agent found again) or notified through its load later than
    it was loaded: idle is counted from that use, so the load stays and notifies the next refused request;
    it goes only once unused for the lease and margin."""
    clock = Clock()
    port = NixlPort(SETTINGS, clock=clock)
    try:
        _, refuse = _refusing(emu)
        with pytest.raises(RemoteRefused) as refused:
            asyncio.run(port.connect(_target(emu), refuse))
        told = refused.value.peer
        clock.t = IDLE_S - 1.0
        if use == "refused again":
            with pytest.raises(RemoteRefused) as again:
                asyncio.run(port.connect(_target(emu), refuse))
            assert again.value.peer is told
        else:
            _, params = new_request(emu, 2)
            port.notify(told, params.remote_request_id)
            assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
        clock.t = IDLE_S + 1.0  # idle since its load, not since its use
        assert port.let_go_notify_only(IDLE_S) == 0
        assert port.agent.agent.check_remote_metadata(told.agent_name)
        _, params = new_request(emu, 2)
        port.notify(told, params.remote_request_id)
        assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
        clock.t = 2 * IDLE_S + 2.0
        assert port.let_go_notify_only(IDLE_S) == 1
        assert not port.agent.agent.check_remote_metadata(told.agent_name)
    finally:
        port.close()


def test_an_idle_notify_only_load_leaves_the_agent_a_peer_reads_through_loaded(emu):
    """A pull holds the prefill's admission when a reload's rules refuse it (a notify-only load of the same
    agent). Letting the idle notify-only load go must not unload the agent the held peer reads through; once
    that peer is let go too, nothing needs the agent and it is unloaded."""
    clock = Clock()
    port = NixlPort(SETTINGS, clock=clock)
    planes = ShmPlanes()
    try:
        reg = port.register([(planes.base, planes.arr.nbytes, 0)], "DRAM")
        dest = port.destination(reg, planes.planes())
        admit, refuse = _refusing(emu)
        held = asyncio.run(port.connect(_target(emu), admit))
        with pytest.raises(RemoteRefused) as refused:
            asyncio.run(port.connect(_target(emu), refuse))
        assert refused.value.peer.agent_name == held.agent_name
        clock.t = IDLE_S + 1.0
        assert port.let_go_notify_only(IDLE_S) == 1
        assert port.agent.agent.check_remote_metadata(held.agent_name)
        reply, params = new_request(emu, 4)
        rid = params.remote_request_id
        port.agent.wait(port.agent.pull(held, dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid))
        check_planes(planes.arr, reply, [0, 1, 2, 3])
        port.remove_peer(held)  # no notify-only load keeps it now
        assert not port.agent.agent.check_remote_metadata(held.agent_name)
        port.deregister(reg)
    finally:
        port.close()
        planes.close()


@pytest.mark.parametrize("peer", ["alone", "sharing its agent"])
def test_close_lets_the_notify_only_loads_go(emu, peer, caplog):
    """A refused prefill's notify-only load, alone or sharing its agent with a peer a pull held: closing lets
    it go with the peers, its agent unloaded once (no failed second removal logged). Before, ``close`` let
    only the peers go and left the agent loaded (and a peer's agent with it) to the NIXL agent's own
    teardown."""
    caplog.set_level(logging.WARNING, "kv_sidecar.nixl")
    t = NixlTransfer(SETTINGS)
    try:
        held = connect(t, emu) if peer == "sharing its agent" else None
        metadata = wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)]
        told = t.load_notify_only(engine_id=emu.ready.engine_id, tp_rank=0, address=address(emu),
                                  agent_metadata=metadata.metadata.agent_metadata)
        assert held is None or told.agent_name == held.agent_name
        t.close()
        assert not t.agent.check_remote_metadata(told.agent_name)
        assert t.let_go_notify_only(-1.0) == 0  # none left to let go
        assert caplog.records == []
    finally:
        t.close()


@pytest.mark.parametrize("metadata", ["whole", "without connection info"])
def test_another_engines_agent_under_a_loaded_name_is_refused_before_nixl_loads_it(emu, fresh, metadata):
    """Another engine's prefill whose agent has the name of one a current peer reads through: a conflict
    (``PeerConflict``, naming the metadata), found before NIXL loads its metadata, so the peer's agent is as
    it was and the peer reads on. Before, NIXL loaded them first: whole metadata (other connection info) it
    refused itself (``add_remote_agent``'s NIXL_ERR_NOT_ALLOWED, a ``TransferFailed``, no conflict), and
    metadata without connection info it merged into the peer's agent (``prep`` of the other prefill's
    region went through the peer's agent) before the conflict was found."""
    from nixl._api import nixl_agent, nixl_agent_config

    planes = ShmPlanes()
    try:
        reg = fresh.register([(planes.base, planes.arr.nbytes, 0)], "DRAM")
        dest = fresh.destination(reg, planes.planes())
        held = connect(fresh, emu)
        other = nixl_agent(held.agent_name, nixl_agent_config(backends=["UCX"]))
        buf = np.zeros(4096, np.uint8)
        other_reg = other.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        md = (other.get_agent_metadata() if metadata == "whole"
              else other.get_partial_agent_metadata(other_reg, False, ["UCX"]))
        with pytest.raises(PeerConflict) as e:
            fresh.add_peer(engine_id="other-engine", tp_rank=0, generation=1, address="127.0.0.2:5600",
                           agent_metadata=md, plan=held.plan, regions=held.regions)
        assert e.value.field == "agent_metadata"
        assert fresh.peer("other-engine", 0) is None and fresh.peer(emu.ready.engine_id, 0) is held
        theirs = np.array([[buf.ctypes.data, 64, 0]], np.uint64)
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # the other prefill's region: not loaded
            fresh.agent.prep_xfer_dlist(held.agent_name, theirs, "DRAM")
        reply, params = new_request(emu, 4)
        rid = params.remote_request_id
        fresh.wait(fresh.pull(held, dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid))
        check_planes(planes.arr, reply, [0, 1, 2, 3])
        fresh.remove_peer(held)
        other.deregister_memory(other_reg)
        fresh.deregister(reg)
    finally:
        planes.close()
