"""The host-call census of benchmarks/host_calls.py reads inductor's output-code log right."""
from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _tool():
    path = os.path.join(os.path.dirname(HERE), "benchmarks", "host_calls.py")
    spec = importlib.util.spec_from_file_location("host_calls", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _block(rank, key, body):
    tag = f"[rank{rank}]:V1130 19:41:01.127000 621 torch/_inductor/graph.py:2552] [{key}] [__output_code] "
    lines = [tag + "    def call(self, args):"] + [tag + line for line in body]
    return lines + [tag + "Output code written to: /tmp/x.py"]


def test_census_counts_rank_zero_decode_graphs_by_kind():
    hc = _tool()
    prefill = ["        extern_kernels.mm(a, b, out=c)"]
    decode = ["        buf1 = empty_strided_cuda((8, 1), (1, 1), torch.bfloat16)",
              "        triton_poi_fused_add_0.run(buf0, buf1, 8, stream=stream0)",
              "        extern_kernels.bmm(x, y, out=z)",
              "        buf2 = torch.ops.dcp.mla_local_attention.default(q, r, kv, pe, 0)",
              "        torch.ops._c10d_functional.all_to_all_single.default(buf3, [1, 1], [1, 1], '0')",
              "        torch.ops._c10d_functional.wait_tensor.default(buf4)",
              "        cpp_fused_mul_1(buf5, buf6)",
              "        del buf1"]
    # two ranks interleaved, as torchrun-style workers write one stream; rank 1 differs
    log = (_block(0, "0/0", prefill) + _block(1, "0/1", decode[:2]) + _block(0, "0/1", decode)
           + _block(0, "0/0", prefill) + _block(0, "0/1", decode[:3]))
    graphs = hc.decode_graphs(log, rank=0)
    assert [g["total"] for g in graphs] == [6, 2]
    assert graphs[0]["generated kernel"] == 2 and graphs[0]["torch.ops.dcp.mla_local_attention.default"] == 1
    assert graphs[0]["torch.ops._c10d_functional.wait_tensor.default"] == 1
    assert [g["total"] for g in hc.decode_graphs(log, rank=1)] == [1]
