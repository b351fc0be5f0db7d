"""The daemon while it starts, in-process on ``FakePort`` whose making (NIXL's agent, seconds on a real node)
the test holds: a real socket in a temporary directory and the real HTTP endpoint."""

from __future__ import annotations

import asyncio
import os
import threading

from sidecar.daemon.app import Daemon
from sidecar.ops.config import Config
from sidecar.standins.fake_transfer import FakePort
from tests.sidecar.daemon.test_serve import http as get


def test_healthz_says_starting_until_the_socket_is_bound(tmp_path):
    """Main: /healthz answered 200 before the socket was bound (a startupProbe on it passed, and the pod
    started vLLM, too early), then 503 "event loop stalled" once start took over 5 s: the tick loop was
    spawned only at its end."""
    path = f"{tmp_path}/gpu0.sock"
    building, release = threading.Event(), threading.Event()

    def make_port(_config: Config) -> FakePort:
        building.set()
        release.wait(20)
        return FakePort()

    daemon = Daemon(Config(socket=f"ipc://{path}", metrics_port=0), make_port=make_port)

    async def main() -> None:
        start = asyncio.ensure_future(daemon.start())
        try:
            assert await asyncio.to_thread(building.wait, 20)
            assert daemon.metrics_server is not None
            healthz = daemon.metrics_server.url + "/healthz"
            assert get(healthz) == (503, "starting\n")
            daemon.health.last_tick -= 10  # as if the start had taken 10 s so far
            assert get(healthz) == (503, "starting\n")
            assert not os.path.exists(path)
            release.set()
            await start
            assert os.path.exists(path)
            assert get(healthz) == (200, "ok\n")
        finally:
            release.set()
            await asyncio.gather(start, return_exceptions=True)
            await daemon.shutdown(0)

    asyncio.run(asyncio.wait_for(main(), 60))
