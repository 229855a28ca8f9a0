"""How fast the Gluon MLA kernel's load pipeline alone streams the latent cache (H200 probe).

The kernel (``kernels/mla_gluon.py``) brings each 64-key tile in by ``cp.async`` into a
ring of STAGES buffers, one tile ahead at 2 stages (all that fits beside q). This probe
runs the same copies (the kernel's own ``_issue_copies``), waits and barriers per tile on
the same grid (one program per split and request, one per SM) with no GEMMs and no softmax:
the time the kernel could not go below with this pipeline. 3 stages (no q beside them) shows
what one more tile in flight would give. Timed next to the real kernel in one run.

At 128 heads a request's tiles are read by two programs, one per 64-row block, as the
kernels do (``row blocks 2``); ``row blocks 1`` streams them once (what this probe did before
2026-12-04, fourth stop, when its 128-head row understated the kernels' reads by half).
``--kernel`` names the kernel timed beside the streams (the lock-step "gluon" by default).

    python benchmarks/probe_gluon_stream.py --out benchmarks/results/gluon_stream_probe_h200.json
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import counts, make_case, time_fn, time_triton  # noqa: E402
from common import floor_ms, probe_parser, probe_shapes  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_gluon as G  # noqa: E402
from dcp_pass.runtime.decode.kernels.splits import split_count  # noqa: E402

if G.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    def _stream_kernel_src(KV, SINK, T, skv_b, skv_t, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           NUM_SPLITS: gl.constexpr):
        """One split of one request: every tile copied into the ring, waited for, fenced and
        barriered as the kernel does (schedule 3's order), then dropped."""
        DL: gl.constexpr = 512
        DR: gl.constexpr = 64
        ld_lat: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        ld_rope: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], gl.bfloat16)
        rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], gl.bfloat16)
        pid_sp = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        rb = gl.program_id(2)
        k_lat_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DL], lat_sl)
        k_rope_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DR], rope_sl)
        split_len = gl.cdiv(gl.cdiv(T, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = pid_sp * split_len
        end = gl.minimum(start + split_len, T)
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
        kv_row = KV + b * skv_b
        kt_row = KV + b * skv_b + DL
        n_lat = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_lat))
        c_lat = gl.arange(0, DL, layout=gl.SliceLayout(0, ld_lat))
        n_rope = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_rope))
        c_rope = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_rope))
        for i in gl.static_range(STAGES - 1):
            G._issue_copies(k_lat_s.index(i), k_rope_s.index(i), start + i * BLOCK_N, end, kv_row, kt_row, skv_t,
                            skv_t, n_lat, c_lat, n_rope, c_rope)
        for it in range(n_tiles):
            nxt = it + STAGES - 1
            G._tile_landed(STAGES - 2)
            slot = nxt % STAGES
            G._issue_copies(k_lat_s.index(slot), k_rope_s.index(slot), start + nxt * BLOCK_N, end, kv_row, kt_row,
                            skv_t, skv_t, n_lat, c_lat, n_rope, c_rope)
        G.cp.wait_group(0)
        G._barrier()
        # one value read back so the copies have a consumer
        v = k_lat_s.index(0).load(ld_lat)
        gl.store(SINK + pid_sp + (b + rb * gl.num_programs(1)) * NUM_SPLITS,
                 gl.sum(gl.sum(v.to(gl.float32), axis=1), axis=0))

    _stream_jit = gluon.jit(_stream_kernel_src)


def stream_ms(kv, stages, ns, row_blocks=1):
    B, T, _ = kv.shape
    sink = torch.empty(B * ns * row_blocks, device=kv.device)

    def run(q, kv_):
        _stream_jit[(ns, B, row_blocks)](kv_, sink, T, kv_.stride(0), kv_.stride(1), BLOCK_N=64, STAGES=stages, NUM_SPLITS=ns,
                             num_warps=8)

    return time_fn(run, [(None, kv)])


def main():
    ap = probe_parser("benchmarks/results/gluon_stream_probe.json", "64x8x32768,64x8x131072,64x32x32768,128x8x32768", 2)
    ap.add_argument("--kernel", default="gluon", help="the kernel timed beside the streams")
    a = ap.parse_args()

    def one_shape(H, B, T, ceil):
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        ns = split_count(B, math.ceil(H / 64), T, torch.device("cuda"))
        kv = sets[0][1]
        kv_bytes = kv.numel() * kv.element_size()
        rbs = math.ceil(H / 64)
        t = {f"kernel {a.kernel}": []}
        for r in sorted({1, rbs}):
            t[f"stream 2 stages, row blocks {r}"] = []
            t[f"stream 3 stages, row blocks {r}"] = []
        for _ in range(a.passes):
            t[f"kernel {a.kernel}"].append(time_triton(sets, path=a.kernel))
            for r in sorted({1, rbs}):
                t[f"stream 2 stages, row blocks {r}"].append(stream_ms(kv, 2, ns, r))
                t[f"stream 3 stages, row blocks {r}"].append(stream_ms(kv, 3, ns, r))
        for name, ts in t.items():
            ms = min(ts)
            yield dict(H=H, B=B, T=T, splits=ns, what=name, ms=ms, passes=ts, floor_ms=floor, of_floor=floor / ms,
                       kv_tb_s=kv_bytes / (ms * 1e-3) / 1e12, kv_of_copy_bw=kv_bytes / (ms * 1e-3) / ceil["copy_bw"])

    probe_shapes(a.out, a.shapes, one_shape, [("H", "H"), ("B", "B"), ("T", "T"), ("splits", "splits"),
                                              ("what", "what"), ("ms", "ms"), ("floor/ms", "of_floor"),
                                              ("KV TB/s", "kv_tb_s"), ("of copy bw", "kv_of_copy_bw")])


if __name__ == "__main__":
    main()
