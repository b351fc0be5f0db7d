"""``Peers`` on a real ``NixlPort`` against the prefill emulator (real NIXL over UCX, a real process): how a
cached handshake is replaced while pulls still read through it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sidecar.daemon.peers import Peers
from sidecar.daemon.port import PeerTarget
from sidecar.nixl.agent import TransferSettings
from sidecar.nixl.port import NixlPort
from sidecar.ops import config
from sidecar.ops.metrics import Metrics
from tests.sidecar.nixl.test_agent import (
    LAYERS,
    SHUF,
    STD,
    ShmPlanes,
    _spawn,
    _stop,
    check_planes,
    local_factors,
    new_request,
    wait_until,
)


def test_a_reload_under_load_replaces_the_peer_without_breaking_the_next_pulls():
    """A pull holds the prefill's admission when a reload changes the rules; the next pull re-admits it and
    the first pull's peer is removed once that pull lets go. The new pull then reads bit-exact: before
    2026-12-07 NIXL handed the re-admission the very peer being retired, and its removal unloaded the agent
    under the new pulls (``prep remote dlist: not found``) until a failed read made the daemon handshake
    again."""
    emu = _spawn("--num-blocks", "64")
    port = NixlPort(TransferSettings())
    planes = ShmPlanes()
    try:
        reg = port.register([(planes.base, planes.arr.nbytes, 0)], "DRAM")
        dest = port.destination(reg, planes.planes())
        fmt = {k: getattr(STD, k) for k in ("kind", "layout", "dtype", "num_heads", "block_size",
                                            "head_size")}
        cfg = config.build({"remotes": [{"match": "127.0.0.1:*", "page_format": fmt}]}, "test")
        caches = SimpleNamespace(page_format=SHUF, layers=[None] * LAYERS, compat_factors=local_factors(emu))
        target = PeerTarget(emu.ready.engine_id, 0, emu.ready.side_channel_host, emu.ready.side_channel_port)

        async def main() -> None:
            peers = Peers(port, lambda: cfg, Metrics(), lambda key, peer: None, asyncio.ensure_future,
                          lambda: None)
            held, handshake = peers.acquire(target, caches)  # a pull reading through the first admission
            old = await handshake
            peers.invalidate()  # a reload changed what prefills are admitted under
            entry, handshake = peers.acquire(target, caches)  # the next pull: admitted again
            new = await handshake
            assert new is not old and peers.admitted(entry.key) is new
            peers.release(held)  # the first pull let go: its peer goes
            reply, params = new_request(emu, 4)
            rid = params.remote_request_id
            read = port.agent.pull(new, dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid)
            port.agent.wait(read)
            check_planes(planes.arr, reply, [0, 1, 2, 3])
            wait_until(lambda: emu.client.status(rid).notif_counts == [1], "the prefill's notification")
            peers.release(entry)
            peers.close()

        asyncio.run(main())
        port.deregister(reg)
    finally:
        port.close()
        planes.close()
        _stop(emu)
