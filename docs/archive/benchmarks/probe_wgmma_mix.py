"""The tensor-core ceiling of the 128-head kernels' matrix work, with no loads and no merge.

Issue #30 item 3 asks the 128-head kernel for 0.85 of the measured matmul rate. Every Gluon
form here (lock-step, role split, seesaw) gives a warpgroup the same matrix work per 64-key
tile and 64 query rows: the score GEMM (q [64, 576] @ K^T, both operands in shared memory:
16 + 16 + 4 m64n64k16 wgmmas) and the value GEMM (P [64, 64] @ V [64, 512], as two m64n256k16
chains of 4, one with P from registers, one with P from shared memory). This probe runs only
that work, in a loop on tiles that never change (shared memory filled once from random bf16
values, as the matmul rate is measured on random data), one warpgroup a program and two
programs an SM (each with its own 72 KiB of q / tile, aliased: the operands' bytes do not
matter, their traffic does), and reports its rate beside torch's bf16 matmul in the same run.

Modes (each a loop body):

* ``values``: the value GEMM alone (P a fixed register tile).
* ``scores``: the score GEMM alone, waited each time.
* ``mix``: scores, wait, P = bf16(s), values, wait: the kernels' order with no softmax.
* ``mix_softmax``: as ``mix`` with the online softmax's arithmetic on s (row max, exp2, row sums
  and the accumulator's rescale), what a warpgroup does between its two GEMMs.
* ``mix_q_regs``: as ``mix`` with the score GEMM's A operand from registers (one [64, 64] tile
  reused for the nine 64-column chunks): the score GEMM's shared-memory traffic halved, to see
  whether that traffic (4 KiB a m64n64k16 from shared memory, 128 bytes a cycle) bounds it.
* ``mix_one``: ``mix`` with one program an SM (one warpgroup's stream alone).

    python benchmarks/probe_wgmma_mix.py --out wgmma_mix_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info, fmt_table, matmul_rate, write_json  # noqa: E402

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,  # noqa: E402
                                                              warpgroup_mma_wait)

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
MODES = ("values", "scores", "mix", "mix_softmax", "mix_q_regs", "mix_one")
_CODE = {"values": 0, "scores": 1, "mix": 2, "mix_softmax": 3, "mix_q_regs": 4, "mix_one": 2}
BH, BN, DL, DR = 64, 64, 512, 64


@gluon.jit
def _mix_kernel(src, out, n_iter, MODE: gl.constexpr):
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    DL: gl.constexpr = 512
    DR: gl.constexpr = 64
    DH: gl.constexpr = 256
    lat = gl.allocate_shared_memory(gl.bfloat16, [BN, DL], gl.NVMMASharedLayout.get_default_for([BN, DL], gl.bfloat16))
    rope = gl.allocate_shared_memory(gl.bfloat16, [BN, DR], gl.NVMMASharedLayout.get_default_for([BN, DR], gl.bfloat16))
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, DL, layout=gl.SliceLayout(0, ld))
    lat.store(gl.load(src + r[:, None] * (DL + DR) + c[None, :]))
    ldr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = gl.arange(0, BN, layout=gl.SliceLayout(1, ldr))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ldr))
    rope.store(gl.load(src + rr[:, None] * (DL + DR) + DL + cr[None, :]))
    fence_async_shared()
    _barrier()
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    a_s: gl.constexpr = gl.DotOperandLayout(0, s_mma, 2)
    a_o: gl.constexpr = gl.DotOperandLayout(0, o_mma, 2)
    acc = gl.zeros([BH, 256], gl.float32, layout=o_mma)
    tot = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, s_mma))
    m_i = gl.full([BH], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_mma))
    p_fixed = rope.load(a_o)  # a [64, 64] register tile: P of the values-only mode
    q_reg = rope.load(a_s)  # the reused A tile of mix_q_regs
    for i in range(n_iter):
        if MODE == 0:
            p_reg = p_fixed
        else:
            if MODE == 4:
                s = warpgroup_mma(q_reg, lat.slice(0, 64, dim=1).permute((1, 0)),
                                  gl.zeros([BH, BN], gl.float32, layout=s_mma), use_acc=False, is_async=True)
                for j in gl.static_range(1, 8):
                    s = warpgroup_mma(q_reg, lat.slice(64 * j, 64, dim=1).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(q_reg, rope.permute((1, 0)), s, is_async=True)
            else:
                s = warpgroup_mma(lat.slice(0, DH, dim=1), lat.slice(0, DH, dim=1).permute((1, 0)),
                                  gl.zeros([BH, BN], gl.float32, layout=s_mma), use_acc=False, is_async=True)
                s = warpgroup_mma(lat.slice(DH, DH, dim=1), lat.slice(DH, DH, dim=1).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(rope, rope.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if MODE == 3:
                s = s * 0.0625
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                p = gl.exp2(s - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                tot = tot * alpha + gl.sum(p, axis=1)
                m_i = m_new
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
            else:
                p = s * 0.0625
                tot += gl.sum(p, axis=1)
            p_reg = gl.convert_layout(p.to(gl.bfloat16), a_o)
        if MODE != 1:
            acc = warpgroup_mma(p_reg, lat.slice(0, DH, dim=1), acc, is_async=True)
            acc = warpgroup_mma(rope, lat.slice(DH, DH, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
    # one number a program, so that nothing above is dead code
    total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(tot, axis=0)
    gl.store(out + gl.program_id(0), total)


def flops_per_iter(mode: str) -> int:
    scores = 2 * BH * BN * (DL + DR)
    values = 2 * BH * BN * DL
    return {"values": values, "scores": scores}.get(mode, scores + values)


def run_mode(mode: str, n_iter: int, reps: int = 5):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms if mode == "mix_one" else 2 * sms
    src = torch.randn(BN, DL + DR, device="cuda").to(torch.bfloat16)
    out = torch.empty(programs, device="cuda")
    launch = lambda: _mix_kernel[(programs,)](src, out, n_iter, MODE=_CODE[mode], num_warps=4)  # noqa: E731
    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    return dict(mode=mode, programs=programs, n_iter=n_iter, ms=ms, ms_all=times,
                tflops=programs * n_iter * flops_per_iter(mode) / (ms * 1e-3) / 1e12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for p in range(a.passes):
        mm = matmul_rate()
        for mode in a.modes.split(","):
            row = run_mode(mode, a.iters)
            row.update(pass_=p, matmul_tflops=mm / 1e12, of_matmul=row["tflops"] * 1e12 / mm)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "ms_all"}, flush=True)
    md = fmt_table(rows, [("pass", "pass_"), ("mode", "mode"), ("programs", "programs"), ("ms", "ms"),
                          ("TFLOP/s", "tflops"), ("matmul TFLOP/s", "matmul_tflops"), ("of matmul", "of_matmul")])
    print(md)
    if a.out:
        write_json(a.out, dict(env=env_info(), rows=rows, table_md=md))


if __name__ == "__main__":
    main()
