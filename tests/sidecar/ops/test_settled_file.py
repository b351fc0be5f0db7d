"""The settled read of a file rewritten in place: the verdict on its three stamps."""

from sidecar.ops import settled_file


def test_a_read_is_settled_only_when_no_stamp_differs():
    """Every pattern of the three stamps (before the read, after it, SETTLE_S later), each field changed in
    turn, in and out of time: one unchanged stamp is the only settled read; a changed one is read again
    while there is time, then refused."""
    import itertools

    base = settled_file.FileStamp(size=120, mtime_ns=1_000, ctime_ns=1_000, inode=7, device=1)
    for field in settled_file.FileStamp._fields:
        other = base._replace(**{field: getattr(base, field) + 1})
        assert settled_file.changed(base, other) == [field] and settled_file.changed(other, base) == [field]
        for stamps in itertools.product((base, other), repeat=3):
            for out_of_time in (False, True):
                verdict = settled_file.settle_verdict(*stamps, out_of_time=out_of_time)
                if stamps[0] == stamps[1] == stamps[2]:
                    assert verdict == "settled", (field, stamps, out_of_time)
                else:
                    assert verdict == ("unsettled" if out_of_time else "retry"), (field, stamps, out_of_time)
    assert settled_file.changed(base, base) == []
    assert settled_file.changed(base, base._replace(size=0, inode=8)) == ["size", "inode"]
