"""The fp8 latent cache (kv_cache_dtype="fp8_e4m3") beside the bf16 cache in the shard-local decode kernel.

DeepSeek-V3 shapes (512 latent + 64 rope columns, scale 192**-0.5, one query token, device
key counts as in a decode step), on one GPU, timed as bench_kernel.py times them: CUDA-graph
replay of one call per rotated input set, the median of triton's do_bench. Per shape:

* ``bf16 split``: a fused bf16 cache [B, T, 576] (1152 B per token) on the split-KV kernel;
* ``bf16 auto``: the same operands on the kernel the chooser picks (Gluon / two-GEMM / split);
* ``fp8_e4m3 split`` / ``wide``, once per fp8 read (``--reads``, DCP_FP8_READ: ``fold``,
  ``fold_qdtype``, ``fold_once``, ``dequant``): packed fp8 rows [B, T, 656] (latent e4m3, 4 fp32 scales,
  bf16 rope), read through their views (runtime/decode/kv_format.py) by the split-KV kernel
  and the two-GEMM kernel; ``auto``: the chooser's pick (the fp8 Gluon kernel, the split or the
  two-GEMM kernel, by their fp8 timings in the path table) with its default read. ``--fold-tiles``: more split rows of the ``fold`` read with the
  16-row bucket's tiles replaced (block_h, block_n, warps, stages, v_split, waves; at 16 heads);
  ``--once-tiles``: the same for the ``fold_once`` read (a seventh number caps registers);
  ``--fold-wide-tiles``: more two-GEMM rows of the ``fold`` read with these WideConfig tiles
  (at 64 heads and more). ``--kernels``: more fp8 rows, one per registry kernel named (e.g.
  ``gluon_fp8``, the Gluon kernel that dequantises each tile into bf16 itself: its read is
  "own", DCP_FP8_READ does not change it).

Each row: H, B, T, dtype, kernel, read, ms, the floor max(bytes / copy bandwidth, flops /
matmul rate) with both ceilings measured in the run, mm_frac and bw_frac (the share of each
ceiling the kernel reaches), vs_bf16 (the bf16 ``auto`` row's ms over this row's: above 1 is
faster than the bf16 cache), rel_err and lse_err (largest absolute LSE difference) against
the fp32 reference of the cache it reads (the dequantised values for fp8) on batch row 0 and,
for fp8, rel_err_vs_bf16 against the fp32 reference of the unquantised values (the
quantisation's own error, default read).

    python benchmarks/bench_fp8.py --out $OUT/fp8_kernel_h200.json
    python benchmarks/bench_fp8.py --reads "" --kernels split,wide,gluon_fp8 --out $OUT/fp8_paths_h200.json \
        --shapes 16x8x32768,...,128x32x131072  # each fp8 kernel with its default read: the path table's fp8 source
    python benchmarks/bench_fp8.py --shapes 128x8x131072,128x32x32768,64x8x32768 --reads dequant \
        --kernels gluon_fp8 --out $OUT/fp8_gluon_h200.json  # the Gluon fp8 kernel beside the others
    TRITON_INTERPRET=1 python benchmarks/bench_fp8.py --shapes 16x2x256 --out /tmp/fp8_dry.json  # CPU dry run
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (KV_LORA, ROPE, SCALE, bench, copy_bandwidth, env_info, floor_ms, fmt_table, graph_of,  # noqa: E402
                    matmul_rate, write_json)

from dcp_pass.runtime.decode.backends import attend, choose_kernel  # noqa: E402
from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_attention  # noqa: E402
from dcp_pass.runtime.decode.kernels import common  # noqa: E402
from dcp_pass.runtime.decode.kernels.common import FP8_READS  # noqa: E402
from dcp_pass.runtime.decode.kernels.mla_wide import WideConfig  # noqa: E402
from dcp_pass.runtime.decode.kernels.reference import attention_impl  # noqa: E402
from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack, views  # noqa: E402

D = KV_LORA + ROPE
L2_BYTES = 60 << 20
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 tl.dot is wrong
LAYOUT = Fp8Layout(KV_LORA, ROPE, DTYPE)
SHAPES = "16x8x32768,16x8x131072,16x32x32768,16x32x131072,128x8x32768,128x8x131072,128x32x32768,128x32x131072"


def counts(B, H, T, row_bytes):
    kv_bytes = B * T * row_bytes
    io_bytes = B * H * (D + KV_LORA) * 2 + B * H * 4
    flops = 2 * B * H * T * (D + KV_LORA)
    return kv_bytes + io_bytes, flops


def bf16_call(q, kv, lens):
    return AttentionCall(q, None, kv, None, KV_LORA, SCALE, kv_lens=lens)


def fp8_call(q, rows, lens):
    """The op's unpacking of packed rows (ops.unpack_fp8_operands), spelled out."""
    latent, scales, rope = views(rows, LAYOUT)
    return AttentionCall(q[..., :KV_LORA], q[..., KV_LORA:], latent, rope, KV_LORA, SCALE, kv_lens=lens,
                         kv_scale=scales)


def make_sets(B, H, T, fp8: bool):
    """Random inputs; several copies when one set would sit in L2 (rotated per call)."""
    one = B * T * (LAYOUT.row_bytes if fp8 else 2 * D)
    n = max(1, min(16, math.ceil(4 * L2_BYTES / max(one, 1)))) if one < 2 * L2_BYTES else 1
    lens = torch.full((B,), T, dtype=torch.long, device=DEV)
    sets = []
    for _ in range(n):
        q = torch.randn(B, 1, H, D, dtype=DTYPE, device=DEV)
        kv = torch.randn(B, T, D, dtype=DTYPE, device=DEV)
        sets.append((q, pack(kv, LAYOUT) if fp8 else kv, lens))
        del kv
    return sets


def time_calls(make_call, kernel, sets, config=None):
    calls = [(lambda s=s: attend(make_call(*s), None if config else kernel, config=config)) for s in sets]
    if DEV != "cuda":
        return bench(calls[0])
    return bench(graph_of(calls)) / len(calls)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def lse_err(lse, ref):
    ok = torch.isfinite(ref)
    return (lse.float()[ok] - ref[ok]).abs().max().item() if ok.any() else 0.0


@contextlib.contextmanager
def fp8_read(read: Optional[str], tiles: Optional[tuple] = None):
    """DCP_FP8_READ set to `read` (None: as it is) and, with split `tiles` (6 numbers, or 7 with
    a register cap for fold_once), the split kernel's tiles of the read for the 16-row bucket
    replaced, inside."""
    table = mla_attention._TUNED_FP8_ONCE if read == "fold_once" else mla_attention._TUNED_FP8_FOLD
    saved_env, saved_tiles = os.environ.get("DCP_FP8_READ"), dict(table)
    if read is not None:
        os.environ["DCP_FP8_READ"] = read
    if tiles is not None and len(tiles) in (6, 7):
        table[16] = tiles  # (for fold: the 16-row bucket has no fold entry of its own)
    try:
        yield
    finally:
        table.clear()
        table.update(saved_tiles)
        if saved_env is None:
            os.environ.pop("DCP_FP8_READ", None)
        else:
            os.environ["DCP_FP8_READ"] = saved_env


def first_row(call):
    """The call on batch row 0 alone (its reference is cheap)."""
    one = lambda t: None if t is None else t[:1]  # noqa: E731
    return call.replace(q_lat=call.q_lat[:1], q_rope=one(call.q_rope), kv=call.kv[:1], pe=one(call.pe),
                        kv_scale=one(call.kv_scale), kv_lens=call.kv_lens[:1])


OWN_READ = ("gluon_fp8",)  # fp8 kernels whose read is their own (DCP_FP8_READ does not apply)


def variants(fp8: bool, reads, fold_tiles, fold_wide_tiles, once_tiles=(), kernels=()):
    """(kernel, read, tiles) of the rows timed for one cache (the two-GEMM kernel reads
    fold_once as fold: no row of its own)."""
    if not fp8:
        return [("split", None, None), ("auto", None, None)]
    rows = [(kernel, read, None) for read in reads for kernel in ("split", "wide")
            if not (kernel == "wide" and read == "fold_once")]
    rows += [("split", "fold", t) for t in fold_tiles] + [("wide", "fold", t) for t in fold_wide_tiles]
    rows += [("split", "fold_once", t) for t in once_tiles]
    rows += [(kernel, None, None) for kernel in kernels]
    return rows + [("auto", None, None)]


def one_shape(H, B, T, ceil, reads=FP8_READS, fold_tiles=(), fold_wide_tiles=(), once_tiles=(), kernels=()):
    rows = []
    bf16_auto_ms = None
    for fp8 in (False, True):
        sets = make_sets(B, H, T, fp8)
        make_call = fp8_call if fp8 else bf16_call
        call0 = make_call(*sets[0])
        ro, rl = attention_impl(first_row(call0), torch.float32)
        row_bytes = LAYOUT.row_bytes if fp8 else 2 * D
        extra_split, extra_wide = (fold_tiles if H <= 16 else ()), (fold_wide_tiles if H >= 64 else ())
        extra_once = once_tiles if H <= 16 else ()
        for kernel, read, tiles in variants(fp8, reads, extra_split, extra_wide, extra_once, kernels):
            with fp8_read(read, tiles):
                try:
                    name = choose_kernel(call0, kernel).name
                except Exception:  # noqa: BLE001 - a kernel that cannot run here: its row says why
                    name = "unavailable"
                rec = dict(H=H, B=B, T=T, dtype="fp8_e4m3" if fp8 else "bf16", kernel=f"{kernel} ({name})",
                           read=("own" if kernel in OWN_READ else read or (
                               common.fp8_read(name) if name in common.DEFAULT_FP8_READ else "")) if fp8 else "")
                if tiles is not None:
                    rec["tiles"] = list(tiles)
                config = WideConfig(*tiles) if tiles is not None and len(tiles) == 8 else None
                try:
                    ms = time_calls(make_call, kernel, sets, config)
                    nbytes, flops = counts(B, H, T, row_bytes)
                    out, lse = attend(first_row(call0), None if config else kernel, config=config)
                    rec.update(ms=ms, floor_ms=floor_ms(nbytes, flops, ceil), kv_bytes=B * T * row_bytes,
                               mm_frac=flops / ceil["mm_rate"] * 1e3 / ms, bw_frac=nbytes / ceil["copy_bw"] * 1e3 / ms,
                               rel_err=rel_err(out, ro), lse_err=lse_err(lse, rl))
                    if not fp8 and kernel == "auto":
                        bf16_auto_ms = ms
                    if bf16_auto_ms:
                        rec["vs_bf16"] = bf16_auto_ms / ms
                except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(rec)
        if fp8:  # the quantisation's own error: against the unquantised values of the same draw
            torch.manual_seed(H * 1000 + B)
            q = torch.randn(1, 1, H, D, dtype=DTYPE, device=DEV)
            kv = torch.randn(1, T, D, dtype=DTYPE, device=DEV)
            lens = torch.full((1,), T, dtype=torch.long, device=DEV)
            out, _ = attend(fp8_call(q, pack(kv, LAYOUT), lens), "split")
            rows[-1]["rel_err_vs_bf16"] = rel_err(out, attention_impl(bf16_call(q, kv, lens), torch.float32)[0])
        del sets, call0
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


COLUMNS = [("H", "H"), ("B", "B"), ("T", "T"), ("cache", "dtype"), ("kernel", "kernel"), ("read", "read"),
           ("tiles", "tiles"), ("ms", "ms"), ("floor ms", "floor_ms"), ("mm frac", "mm_frac"), ("bw frac", "bw_frac"),
           ("vs bf16", "vs_bf16"), ("rel err", "rel_err"), ("lse err", "lse_err"),
           ("rel err vs bf16 values", "rel_err_vs_bf16")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="HxBxT,...")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "fp8_kernel_h200.json"))
    ap.add_argument("--reads", default=",".join(FP8_READS), help="fp8 reads to time (DCP_FP8_READ values)")
    ap.add_argument("--fold-wide-tiles", default="",
                    help="semicolon-separated WideConfig tiles (block_m,block_n,block_k,warps_a,stages_a,block_v,"
                         "warps_b,stages_b): more fold rows of the two-GEMM kernel at 64 heads and more")
    ap.add_argument("--fold-tiles", default="",
                    help="semicolon-separated block_h,block_n,warps,stages,v_split,waves: more fold rows of the split "
                         "kernel with these 16-row tiles")
    ap.add_argument("--once-tiles", default="",
                    help="semicolon-separated block_h,block_n,warps,stages,v_split,waves[,max_regs]: more fold_once "
                         "rows of the split kernel with these 16-row tiles")
    ap.add_argument("--kernels", default="", help="comma-separated registry kernels: more fp8 rows, one each")
    a = ap.parse_args(argv)
    reads = [r for r in a.reads.split(",") if r]
    bad = sorted(set(reads) - set(FP8_READS))
    if bad:
        ap.error(f"--reads: {bad} are not fp8 reads ({', '.join(FP8_READS)})")
    fold_tiles = [tuple(float(x) if i == 5 else int(x) for i, x in enumerate(t.split(",")))
                  for t in a.fold_tiles.split(";") if t]
    fold_wide_tiles = [tuple(int(x) for x in t.split(",")) for t in a.fold_wide_tiles.split(";") if t]
    once_tiles = [tuple(float(x) if i == 5 else int(x) for i, x in enumerate(t.split(",")))
                  for t in a.once_tiles.split(";") if t]
    torch.manual_seed(0)
    results = dict(env=env_info(), layout=LAYOUT.spec(), row_bytes=LAYOUT.row_bytes)
    ceil = dict(copy_bw=copy_bandwidth(device=DEV), mm_rate=matmul_rate(device=DEV))
    results["ceilings"] = ceil
    rows = []
    for sh in a.shapes.split(","):
        H, B, T = (int(x) for x in sh.split("x"))
        for rec in one_shape(H, B, T, ceil, reads, fold_tiles, fold_wide_tiles, once_tiles,
                             [k for k in a.kernels.split(",") if k]):
            rows.append(rec)
            print("row", rec, flush=True)
        results["rows"] = rows
        write_json(a.out, results)
    results["table_md"] = fmt_table(rows, COLUMNS)
    write_json(a.out, results)
    print(results["table_md"], flush=True)


if __name__ == "__main__":
    main()
