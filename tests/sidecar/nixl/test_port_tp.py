"""``NixlPort`` reading several prefill ranks (heterogeneous TP), on a stub agent that records what would go
to each prefill: every rank notified exactly once when a read fails while posting, and a layer range handed
to the conversion only once every rank's read of it has landed. The real agent's byte paths are covered by
tests/e2e/test_tp.py."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest

from sidecar.daemon.port import PeerSet
from sidecar.nixl.errors import RemoteDisconnected, TransferFailed
from sidecar.nixl.port import NixlPort, ReadGroup
from sidecar.nixl.reads import ReadOp


@dataclass(eq=False)
class StubPeer:
    agent_name: str
    tp_rank: int
    notif_count: int = 1
    address: str = "127.0.0.1:5600"


@dataclass
class StubAgent:
    """Posts reads as ReadOps; ``fail_on`` ranks fail while posting (notified, as NixlReads._fail does)."""

    fail_on: set[int] = field(default_factory=set)
    sent: list[tuple[str, str, int]] = field(default_factory=list)  # (agent, request id, n)
    pairs_seen: list[tuple[str, object]] = field(default_factory=list)  # ("table"/"pull", pairs) per call

    def pull(self, peer, dest, mode, local_ids, remote_ids, rid, *, readers, **kw):
        self.pairs_seen.append(("pull", kw.get("pairs")))
        op = ReadOp(peer=peer, remote_request_id=rid, readers=readers, deadline=1e18)
        if peer.tp_rank in self.fail_on:
            self._notify_once(op)
            raise TransferFailed("make_prepped_xfer failed")
        op.layer_ranges = [(0, 1), (1, 2)]
        op.handles = [object(), object()]
        op.sealed = True
        return op

    @contextlib.contextmanager
    def hold(self, blocking=True):
        yield True

    def _notify_once(self, op):
        if not op.notified:
            op.notified = True
            self.sent.append((op.peer.agent_name, op.remote_request_id, op.readers))

    def abort(self, op):
        op.finished = True
        op.handles = []
        self._notify_once(op)
        return True

    def notify_agent(self, agent, rid, n):
        self.sent.append((agent, rid, n))

    def poll(self, op, now):
        return op.finished

    def geometry(self, peer, dest, mode, pool=None):
        return Unsliced()

    def table(self, geo, mode, *args):
        self.pairs_seen.append(("table", args[-1]))  # (ids, tokens, pool, slots, gaps, pairs)
        return ("descriptors of", mode)  # built once per rank before any post; pull receives it


class Unsliced:
    source = None  # the multi-rank pre-check has nothing to slice


def port_with(agent: StubAgent) -> NixlPort:
    port = NixlPort.__new__(NixlPort)  # no NIXL agent: the stub stands in for NixlTransfer
    port.agent = agent
    port._spent = {}
    return port


PEERS = PeerSet(tuple(StubPeer(f"agent-{r}", r) for r in range(3)))


def read(port, rid="req", pairs=None):
    return port.read(PEERS, None, "direct", [1], [1], rid, layer_groups=2, timeout_s=5.0,
                     remote_num_tokens=None, pairs=pairs)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_rank_failing_while_posting_leaves_every_rank_told_exactly_once(failing):
    agent = StubAgent(fail_on={failing})
    port = port_with(agent)
    with pytest.raises(TransferFailed):
        read(port)
    port.notify(PEERS, "req")  # what the daemon's quiesce does next: must not tell anyone twice
    assert sorted(agent.sent) == [(f"agent-{r}", "req", 1) for r in range(3)]
    port.notify(PEERS, "other")  # other requests are untouched
    assert [s for s in agent.sent if s[1] == "other"] == [(f"agent-{r}", "other", 1) for r in range(3)]


@dataclass
class UnreachableRank(StubAgent):
    """Rank 2 cannot be told (its prefill died), and a posted read does not stop at once."""

    def notify_agent(self, agent, rid, n):
        if agent == "agent-2":
            raise RemoteDisconnected("send_notif: the remote agent disconnected")
        super().notify_agent(agent, rid, n)

    def abort(self, op):
        op.finished = True
        self._notify_once(op)
        return False  # its handles are still in flight


def test_a_rank_that_cannot_be_told_keeps_the_posted_reads_and_tells_no_rank_twice():
    """Rank 1 fails while posting, rank 0's read is still in flight, rank 2 cannot be notified: the error
    the caller sees still carries rank 0's read to stop, and the daemon's own notify tells nobody again.
    Before, the notification's error replaced the post's, losing the read (answered safe while it wrote)."""
    agent = UnreachableRank(fail_on={1})
    port = port_with(agent)
    with pytest.raises(TransferFailed) as raised:
        read(port)
    assert isinstance(raised.value.read, ReadGroup)
    assert [op.peer.tp_rank for op in raised.value.read.ops] == [0]  # rank 1 posted nothing
    port.notify(PEERS, "req")
    assert sorted(agent.sent) == [("agent-0", "req", 1), ("agent-1", "req", 1)]


def test_reads_of_every_rank_are_one_group():
    agent = StubAgent()
    group = read(port_with(agent))
    assert isinstance(group, ReadGroup) and [op.peer.tp_rank for op in group.ops] == [0, 1, 2]
    assert agent.sent == []  # nothing told before the reads are done


def test_every_rank_builds_its_descriptors_from_the_loops_pairs():
    agent = StubAgent()
    pairs = object()  # the stub geometry does not look inside; the real one checks the rule per rank
    read(port_with(agent), pairs=pairs)
    assert agent.pairs_seen == [("table", pairs)] * 3 + [("pull", pairs)] * 3


def test_notify_sends_each_rank_its_own_n():
    agent = StubAgent()
    port = port_with(agent)
    peers = PeerSet((StubPeer("a", 0, notif_count=2),))
    port.notify(peers, "x")
    port.notify(peers, "x")  # a second, separate notification is the caller's business: sent again
    assert agent.sent == [("a", "x", 2), ("a", "x", 2)]


def test_a_layer_range_lands_once_every_rank_has_it():
    agent = StubAgent()
    ops = [agent.pull(StubPeer(f"a{r}", r), None, "direct", [1], [1], "q", readers=1) for r in range(2)]
    group = ReadGroup(ops)
    ops[0].landed.append((1, 2))
    group.take_landed()
    assert group.landed == []  # rank 1 has not read layer 1 yet
    ops[1].landed += [(0, 1), (1, 2)]
    group.take_landed()
    assert group.landed == [(1, 2)]
    ops[0].landed.append((0, 1))
    group.take_landed()
    assert group.landed == [(1, 2), (0, 1)]
    assert not group.finished and group.done_at is None
    for op, t in zip(ops, (3.0, 5.0), strict=True):
        op.finished, op.done_at, op.nbytes = True, t, 10
    assert group.finished and group.done_at == 5.0 and group.nbytes == 20


@dataclass
class CrashingRank(UnreachableRank):
    """Rank 1's post raises something other than a TransferError (a bug, MemoryError) before NIXL told it;
    rank 0's read is still in flight."""

    def notify_agent(self, agent, rid, n):
        StubAgent.notify_agent(self, agent, rid, n)

    def pull(self, peer, dest, mode, local_ids, remote_ids, rid, *, readers, **kw):
        if peer.tp_rank == 1:
            raise MemoryError("building the descriptors")
        return super().pull(peer, dest, mode, local_ids, remote_ids, rid, readers=readers, **kw)


def test_a_rank_failing_with_any_error_keeps_the_posted_reads_and_tells_every_rank_once():
    """The error the caller sees carries rank 0's read still in flight, whatever the error's type: without
    it the daemon stops nothing and answers (giving the blocks back) while that READ may still write. The
    failing rank, which its own pull did not tell, is told too, and nobody twice by the daemon's stop."""
    agent = CrashingRank()
    port = port_with(agent)
    with pytest.raises(MemoryError) as raised:
        read(port)
    group = getattr(raised.value, "read", None)
    assert isinstance(group, ReadGroup)
    assert [op.peer.tp_rank for op in group.ops] == [0]
    assert not port.abort(group)  # the daemon's stop: still in flight, so its blocks are not safe yet
    port.notify(PEERS, "req")
    assert sorted(agent.sent) == [(f"agent-{r}", "req", 1) for r in range(3)]


def test_a_rank_that_cannot_be_told_does_not_keep_the_next_ranks_from_being_told():
    """The daemon's own notification of a read never posted (stopped before its post, a lease or generation
    check failed): the first rank's prefill cannot be reached, and the ranks after it must still be told,
    each once; the failure is still raised for the caller to log."""
    agent = UnreachableRank()  # agent-2 cannot be told
    port = port_with(agent)
    peers = PeerSet(tuple(reversed(PEERS.peers)))  # the unreachable rank first
    with pytest.raises(RemoteDisconnected):
        port.notify(peers, "req")
    assert sorted(agent.sent) == [("agent-0", "req", 1), ("agent-1", "req", 1)]
