"""UCX's own logs: the protocol tables of ``UCX_PROTO_INFO=y`` and what they say carried the reads."""

from sidecar.bench import ucx_logs

# Two protocol tables of one UCX log as UCX 1.23 prints them (UCX_PROTO_INFO=y), with a line of another
# thread of the same process in between; the first read by cma (CPU), the second by cuda_ipc (GPU).
UCX_LOG = """\
[1795956614.58] [vm:8744 :1]      ucp_worker.c:1997 UCX  INFO    kv-sidecar-bcd intra-node cfg#1 \
rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1795956614.58] [vm:8744 :1]   +--------+-------------+-------------------------------------------+
[1795956614.58] [vm:8744 :1]   | kv-sidecar-bcd intra-node cfg#1                                  |
[1795956614.58] [vm:8744 :1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795956614.58] [vm:8744 :1]   +--------+-------------+-------------------------------------------+
[1795956614.58] [vm:8744 :0]   | kv-sidecar-bcd self cfg#0                                        |
[1795956614.58] [vm:8744 :1]   | Range  | Description |                  Config                   |
[1795956614.58] [vm:8744 :1]   +--------+-------------+-------------------------------------------+
[1795956614.58] [vm:8744 :1]   | 0..inf | zero-copy   | cma/memory                                |
[1795956614.58] [vm:8744 :1]   +--------+-------------+-------------------------------------------+
[1795956614.59] [vm:8744 :0]   | active message by ucp_am_send* from host memory                  |
[1795956614.59] [vm:8744 :0]   | 0..inf | zero-copy   | tcp/lo                                    |
[1795956615.01] [vm:8744 :1]   | kv-sidecar-bcd intra-node cfg#2                                  |
[1795956615.01] [vm:8744 :1]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/GPU0 |
[1795956615.01] [vm:8744 :1]   |   0..8k | short      | rma_am tcp/lo                               |
[1795956615.01] [vm:8744 :1]   | 8k..inf | zero-copy  | cuda_ipc/cuda                               |
[1795956615.02] [vm:8744 :1]     cuda_ipc_iface.c:99 UCX  INFO cuda-ipc get zcopy disabled as no nvlinks \
detected
"""


def test_proto_tables_are_read_per_thread_and_name_their_transports(tmp_path) -> None:
    tables = ucx_logs.parse_proto_tables(UCX_LOG)
    assert [(t.scope, t.operation.split(" into ")[0]) for t in tables] == [
        ("intra-node", "remote memory read by ucp_get*(multi)"),
        ("self", "active message by ucp_am_send* from host memory"),
        ("intra-node", "remote memory read by ucp_get*(multi)"),
    ]
    assert (
        tables[0].rows == [ucx_logs.ProtoRow("0..inf", "zero-copy", "cma/memory")] and tables[0].pid == 8744
    )
    assert [ucx_logs.transports_of(r.config) for r in tables[2].rows] == [["tcp"], ["cuda_ipc"]]
    log = tmp_path / "ucx-daemon-direct-8744.log"
    log.write_text(UCX_LOG)
    s = ucx_logs.summarize_ucx_logs([str(log), str(tmp_path / "missing.log")], "kv-sidecar")
    assert s["read_transports"] == ["cma", "cuda_ipc", "tcp"]  # self-scope and non-read tables left out
    assert [r["transports"] for r in s["reads"]] == [["cma"], ["cuda_ipc", "tcp"]]
    assert s["endpoint_lanes"] == [
        {
            "scope": "intra-node",
            "lanes": {"rma_am": ["tcp"], "amo_am": ["tcp"], "am": ["tcp", "cma"], "ka": ["tcp"]},
        }
    ]
    assert any("no nvlinks" in n for n in s["notes"])
    assert ucx_logs.summarize_ucx_logs([str(log)], "bench-bare")["read_transports"] == []
