"""Local (shard) MLA decode attention on one GPU: Triton kernel vs einsum vs flex_attention.

DeepSeek-V3 shapes: fused 512 + 64 latent cache in bf16, scale 192**-0.5, one query token.
Ceilings are measured in the same run (device-to-device copy bandwidth, bf16 matmul rate)
and every kernel time is set against the floor max(bytes / copy bw, flops / matmul rate).

    python benchmarks/bench_kernel.py --out results.json [--sweep] [--wide-sweep] [--no-table] [--flex]

--sweep times a set of launch configurations of the fused split-KV kernel at a few shapes
(to pick the heuristics in mla_attention.pick_config); --wide-sweep the same for the
two-GEMM wide-head kernels (mla_wide). The table times the split-KV kernel with its own
choices (path="split") and, for >= --wide-min-rows rows, the wide path next to it
(columns "wide ..."; same floor); "auto" says which one the dispatcher picks.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (KV_LORA, ROPE, SCALE, bench, copy_bandwidth, env_info, floor_ms, fmt_table,  # noqa: E402
                    graph_of, matmul_rate, write_json)

from dcp_pass.runtime.decode.backends import attend, choose_kernel  # noqa: E402
from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels.reference import attention_impl  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_attention as M  # noqa: E402
from dcp_pass.runtime.decode.kernels.gluon import common as GC  # noqa: E402
from dcp_pass.runtime.decode.kernels.gluon import lock_step as G  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_wide as W  # noqa: E402
from dcp_pass.runtime.decode.kernels import splits as SP  # noqa: E402
from dcp_pass.runtime.decode.kernels.splits import split_count  # noqa: E402

D = KV_LORA + ROPE
L2_BYTES = 60 << 20
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script under TRITON_INTERPRET=1
# the interpreter's bf16 tl.dot is wrong (kernels refuse it), so a CPU dry run takes fp16
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16


def counts(B, S, H, T):
    kv_bytes = B * T * D * 2
    io_bytes = B * S * H * (D + KV_LORA) * 2 + B * S * H * 4
    flops = 2 * B * S * H * T * (D + KV_LORA)
    return kv_bytes + io_bytes, flops


def fastest_per_shape(rows):
    """The fastest timed row of a sweep for every (H, B, T)."""
    best = {}
    for r in rows:
        if "ms" in r:
            k = (r["H"], r["B"], r["T"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    return list(best.values())


def make_case(B, S, H, T, device=DEV):
    """Random inputs; several copies when one set would sit in L2 (rotated per call)."""
    one = B * T * D * 2
    n = max(1, min(16, math.ceil(4 * L2_BYTES / max(one, 1)))) if one < 2 * L2_BYTES else 1
    sets = []
    for _ in range(n):
        q = torch.randn(B, S, H, D, dtype=DTYPE, device=device)
        kv = torch.randn(B, T, D, dtype=DTYPE, device=device)
        sets.append((q, kv))
    return sets


def einsum_mla(q, kv, scale=SCALE):
    """The model's absorbed-MLA einsum math in bf16 (scores in bf16, softmax in fp32)."""
    scores = torch.einsum("bshc,btc->bsht", q, kv) * scale
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bsht,btc->bshc", p, kv[..., :KV_LORA])


def rotating(fn, sets):
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def time_fn(fn, sets, graph=True, **kw):
    """Median ms per call: CUDA-graph replay of one call per input set (launch overhead
    out of the number, as in a graph-captured decode step), or eager with rotation."""
    if graph and DEV == "cuda":
        replay = graph_of([(lambda q=q, kv=kv: fn(q, kv)) for q, kv in sets])
        return bench(replay, **kw) / len(sets)
    fn(*sets[0])
    return bench(rotating(fn, sets), **kw)


def triton_call(config=None, path="split", extras=None):
    """One call of a kernel on (q, kv) with ``extras`` (AttentionCall's mask / q_pos) added: the
    kernel ``path`` names, or the one ``config`` configures ("gluon" without a config: the
    default Gluon config's)."""
    if path == "gluon" and config is None:
        config = G.GLUON_DEFAULT
    kernel = None if config is not None else path
    return lambda q, kv: attend(AttentionCall(q, None, kv, None, KV_LORA, SCALE, **(extras or {})), kernel,
                                config=config)


def time_triton(sets, config=None, graph=True, path="split", extras=None):
    return time_fn(triton_call(config, path, extras), sets, graph)


def check(sets, path="split", config=None, extras=None):
    """(relative error, max LSE error) of batch row 0 against the fp32 reference, with the
    same mask / causal ``extras``."""
    q, kv = sets[0]
    o, lse = triton_call(config, path, extras)(q, kv)
    extras = {k: v[:1] for k, v in (extras or {}).items()}
    ro, rl = attention_impl(AttentionCall(q[:1], None, kv[:1], None, KV_LORA, SCALE, **extras), torch.float32)
    err = ((o[:1].float() - ro).norm() / ro.norm()).item()
    lerr = (lse[:1] - rl).abs().max().item()
    return err, lerr


def sweep(results, ceil, tuned_path=None):
    shapes = [(16, 1, 131072), (16, 8, 65536), (16, 32, 16384), (16, 32, 131072),
              (128, 1, 131072), (128, 8, 32768), (128, 32, 65536), (64, 8, 65536), (64, 32, 131072)]
    if DEV == "cpu":
        shapes = [(16, 1, 64), (64, 1, 64)]
    cfgs = {  # (block_h, block_n, warps, stages, v_split)
        16: [(16, 64, 4, 2, 1), (16, 32, 4, 2, 1), (16, 32, 4, 3, 1), (16, 64, 8, 2, 1)],
        64: [(64, 32, 4, 3, 2), (64, 32, 4, 2, 2), (64, 64, 4, 2, 2), (64, 32, 8, 2, 1), (32, 32, 4, 2, 1)],
    }
    out = []
    for H, B, T in shapes:
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        bucket = 16 if H <= 16 else 64
        for (bh, bn, w, st, vs) in cfgs[bucket]:
            n_prog = -(-H // bh) * vs
            for waves in (1, 2, 4):
                ns = split_count(B, n_prog, T, torch.device(DEV), waves)
                cfg = M.MLAKernelConfig(bh, bn, w, st, ns, vs)
                rec = dict(H=H, B=B, T=T, bucket=bucket, block_h=bh, block_n=bn, warps=w, stages=st, v_split=vs,
                           waves=waves, splits=ns)
                try:
                    t = time_triton(sets, cfg)
                    rec.update(ms=t, floor_ms=floor, of_floor=floor / t,
                               bw_frac=nbytes / (t * 1e-3) / ceil["copy_bw"],
                               mm_frac=flops / (t * 1e-3) / ceil["mm_rate"])
                except Exception as e:  # a config may not compile (shared memory) on this GPU
                    rec.update(error=repr(e)[:300])
                out.append(rec)
                print("sweep", rec, flush=True)
        del sets
        if DEV == "cuda":
            torch.cuda.empty_cache()
    results["sweep"] = out
    results["sweep_best"] = fastest_per_shape(out)
    # one config per bucket: best geometric mean of floor/time over that bucket's shapes
    tuned = {}
    for bucket in cfgs:
        score = {}
        for r in out:
            if r.get("bucket") == bucket:
                key = (r["block_h"], r["block_n"], r["warps"], r["stages"], r["v_split"], r["waves"])
                score.setdefault(key, []).append(math.log(r["of_floor"]) if "ms" in r else -1e9)
        n = max(len(v) for v in score.values())
        key = max((k for k in score if len(score[k]) == n), key=lambda k: sum(score[k]))
        tuned[str(bucket)] = list(key)
    results["tuned"] = tuned
    if tuned_path:
        write_json(tuned_path, tuned)
    print("tuned", tuned, flush=True)
    print(fmt_table(results["sweep_best"], [("H", "H"), ("B", "B"), ("T", "T"), ("cfg", lambda r: f"{r['block_h']}/{r['block_n']}/{r['warps']}w/{r['stages']}s/v{r['v_split']} x{r['waves']}"),
                                           ("splits", "splits"), ("ms", "ms"), ("of floor", "of_floor")]), flush=True)


WIDE_CFGS = [  # (block_m, block_n, block_k, warps_a, stages_a, block_v, warps_b, stages_b), offline-checked
    (128, 128, 64, 8, 3, 256, 8, 2),  # default (mla_wide.WIDE_DEFAULT)
    (128, 128, 64, 8, 4, 256, 8, 2),
    (128, 64, 64, 8, 3, 256, 8, 2),
    (128, 64, 64, 8, 4, 256, 8, 3),
    (128, 128, 64, 8, 3, 128, 8, 3),
    (128, 256, 64, 8, 3, 128, 8, 2),
    (64, 128, 64, 4, 3, 256, 8, 2),
]


def wide_sweep(results, ceil):
    """Tile configs of the two-GEMM kernels at B=8/32, H=64/128, T=64K/128K, 1 or 2 waves of splits."""
    shapes = [(H, B, T) for H in (64, 128) for B in (8, 32) for T in (65536, 131072)]
    cfgs = WIDE_CFGS
    if DEV == "cpu":
        shapes, cfgs = [(64, 1, 64)], [(16, 16, 16, 4, 1, 256, 4, 1)]
    out = []
    for H, B, T in shapes:
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        seen = set()
        for c in cfgs:
            for waves in (1.0, 2.0):
                base = W.WideConfig(*c, waves=waves)
                cfg = W.pick_wide_config(H, KV_LORA + ROPE, 0, KV_LORA, B, T, torch.device(DEV), elem_bytes=2,
                                         base=base) if DEV == "cuda" else W.WideConfig(*c, num_splits=2)
                key = cfg.tag().rsplit(" x", 1)[0], cfg.num_splits  # the launch, whatever the waves asked
                if key in seen:  # the same launch after fitting to the shape
                    continue
                seen.add(key)
                rec = dict(H=H, B=B, T=T, cfg=list(c), waves=waves, tag=cfg.tag(), splits=cfg.num_splits)
                try:
                    if DEV == "cuda":
                        err, lerr = check(sets, "wide", base)
                        rec.update(rel_err=err, lse_err=lerr)
                    t = time_triton(sets, cfg if DEV != "cuda" else base, path="wide")
                    rec.update(ms=t, floor_ms=floor, of_floor=floor / t, mm_frac=flops / (t * 1e-3) / ceil["mm_rate"])
                except Exception as e:  # a config may not compile (shared memory) on this GPU
                    rec.update(error=repr(e)[:300])
                out.append(rec)
                print("wide-sweep", rec, flush=True)
        del sets
        if DEV == "cuda":
            torch.cuda.empty_cache()
    results["wide_sweep"] = out
    results["wide_sweep_best"] = fastest_per_shape(out)
    score = {}
    for r in out:
        score.setdefault((tuple(r["cfg"]), r["waves"]), []).append(math.log(r["of_floor"]) if "ms" in r else -1e9)
    key = max(score, key=lambda k: sum(score[k]))
    results["wide_tuned"] = dict(cfg=list(key[0]), waves=key[1])
    print("wide tuned (best geometric mean of floor/time)", results["wide_tuned"], flush=True)
    print(fmt_table(results["wide_sweep_best"], [("H", "H"), ("B", "B"), ("T", "T"), ("config", "tag"), ("splits", "splits"),
                                           ("ms", "ms"), ("of floor", "of_floor"),
                                           ("% mm rate", lambda r: f"{100 * r['mm_frac']:.0f}")]), flush=True)


def flex_token(results):
    """One small shape through torch flex_attention (compiled), as the notes call it."""
    rec = dict(B=1, H=16, T=4096)
    try:
        from torch.nn.attention.flex_attention import flex_attention

        q = torch.randn(1, 16, 1, D, dtype=torch.bfloat16, device="cuda")
        kv = torch.randn(1, 1, 4096, D, dtype=torch.bfloat16, device="cuda")
        v = kv[..., :KV_LORA]
        f = torch.compile(flex_attention)
        f(q, kv, v, scale=SCALE, enable_gqa=True, return_lse=True)
        rec["ms"] = bench(lambda: f(q, kv, v, scale=SCALE, enable_gqa=True, return_lse=True))
        rec["triton_ms"] = time_triton(make_case(1, 1, 16, 4096), graph=False)
    except Exception as e:
        rec["error"] = repr(e)[:300]
    results["flex"] = rec
    print("flex", rec, flush=True)


GLUON_CONFIGS = ["64,64,2,6,128", "64,64,2,3,128", "64,64,2,6,0", "64,64,2,3,0"]  # block_h, block_n, stages, schedule, q_reg


def gluon_rows(rec, sets, ceil, t_split, floor, flops, configs=None):
    """Time the Gluon one-read kernel (kernels/gluon/lock_step.py) on one case: its default
    configuration (what the dispatcher runs; the ``gluon_*`` fields) and then ``configs``
    (``gluon_all``, with the fastest of all named in ``gluon_best_cfg``)."""
    for tag in ["default"] + list(configs or GLUON_CONFIGS):
        gcfg = G.GluonConfig() if tag == "default" else G.GluonConfig.parse(tag)
        name = "default: " + gcfg.tag() if tag == "default" else gcfg.tag()
        try:
            gerr, glerr = check(sets, "gluon", gcfg)
            tg = time_triton(sets, gcfg, path="gluon")
        except Exception as e:
            rec.setdefault("gluon_errors", []).append(f"{tag}: {e!r}"[:300])
            traceback.print_exc()
            continue
        mm_frac = flops / (tg * 1e-3) / ceil["mm_rate"]
        rec.setdefault("gluon_all", {})[name] = dict(ms=tg, mm_frac=mm_frac, rel_err=gerr)
        if tag == "default":
            rec.update(gluon_cfg=name, gluon_rel_err=gerr, gluon_lse_err=glerr, gluon_ms=tg,
                       gluon_mm_frac=mm_frac, gluon_of_floor=floor / tg, gluon_vs_split=t_split / tg)
        if "gluon_best_ms" not in rec or tg < rec["gluon_best_ms"]:
            rec.update(gluon_best_cfg=name, gluon_best_ms=tg)


def reduce_only_ms(B, H, ns):
    """Time the stage-2 merge alone over ``ns`` fp32 partials (what a split launch adds)."""
    o_part = torch.randn(B, ns, H, KV_LORA, device=DEV)
    l_part = torch.randn(B, ns, H, device=DEV)
    out = torch.empty(B, 1, H, KV_LORA, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(B, 1, H, device=DEV)
    kernel, grid, args, consts, warps = SP.reduce_launch(o_part, l_part, out, lse, H, "e", KV_LORA, ns)
    return time_fn(lambda q, kv: kernel[grid](*args, **consts, num_warps=warps), [(None, None)])


def time_without_merge(sets, cfg):
    """The Gluon launch with the stage-2 merge kernel skipped (its output is then garbage): the
    launch every Gluon kernel's plan goes through (gluon.common.launch_plan) is wrapped."""
    real = GC.launch
    GC.launch = lambda kernel, *a, **k: None if kernel is SP._reduce_jit else real(kernel, *a, **k)
    try:
        return time_triton(sets, cfg, path="gluon")
    finally:
        GC.launch = real


def gluon_split_sweep(results, ceil, shapes, splits):
    """The Gluon kernel's time against its split count at a few shapes, and the merge's share."""
    rows = []
    for H, B, T in shapes:
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        auto = split_count(B, math.ceil(H / G.GLUON_DEFAULT.block_h), T, torch.device(DEV))
        for ns in sorted(set(splits) | {auto}):
            rec = dict(H=H, B=B, T=T, splits=ns, auto=ns == auto)
            try:
                cfg = G.GluonConfig(num_splits=ns)
                rec["rel_err"] = check(sets, "gluon", cfg)[0]
                t = time_triton(sets, cfg, path="gluon")
                rec.update(ms=t, of_floor=floor / t, mm_frac=flops / (t * 1e-3) / ceil["mm_rate"],
                           reduce_ms=reduce_only_ms(B, H, ns) if ns > 1 else 0.0)
                if ns > 1:  # the same launch without its stage-2 merge: what the merge costs in-stream
                    rec["no_merge_ms"] = time_without_merge(sets, cfg)
            except Exception as e:
                rec["error"] = repr(e)[:300]
                traceback.print_exc()
            rows.append(rec)
            print("gluon-splits", rec, flush=True)
        del sets
        results["gluon_split_sweep"] = rows
    print(fmt_table(rows, [("H", "H"), ("B", "B"), ("T", "T"), ("splits", "splits"), ("auto", "auto"), ("ms", "ms"),
                           ("of floor", "of_floor"), ("mm frac", "mm_frac"), ("merge alone ms", "reduce_ms"),
                           ("ms without merge", lambda r: r.get("no_merge_ms", ""))]), flush=True)


def table(results, ceil, heads, batches, ctxs, einsum=True, wide_min_rows=64, gluon=False, gluon_configs=None):
    rows = []
    for H, B, T in itertools.product(heads, batches, ctxs):
        rec = dict(H=H, B=B, T=T)
        try:
            sets = make_case(B, 1, H, T)
            nbytes, flops = counts(B, 1, H, T)
            cfg = M.pick_config(H, KV_LORA, ROPE, B, T, torch.device(DEV))
            rec.update(cfg=f"{cfg.block_h}/{cfg.block_n}/{cfg.num_warps}w/{cfg.num_stages}s/v{cfg.v_split}",
                       splits=cfg.num_splits,
                       bytes=nbytes, flops=flops)
            err, lerr = check(sets)
            rec.update(rel_err=err, lse_err=lerr)
            t = time_triton(sets)
            rec["eager_ms"] = time_triton(sets, graph=False)
            floor = floor_ms(nbytes, flops, ceil)
            q0, kv0 = sets[0]
            # what the chooser picks for this call (the "ms" column times the split kernel)
            rec["auto"] = choose_kernel(AttentionCall(q0, None, kv0, None, KV_LORA, SCALE), "triton").name
            if H >= wide_min_rows:
                try:
                    wcfg = W.pick_wide_config(H, KV_LORA + ROPE, 0, KV_LORA, B, T, torch.device(DEV))
                    werr, wlerr = check(sets, "wide")
                    tw = time_triton(sets, path="wide")
                    rec.update(wide_cfg=wcfg.tag(), wide_splits=wcfg.num_splits, wide_rel_err=werr, wide_lse_err=wlerr,
                               wide_ms=tw, wide_of_floor=floor / tw, wide_mm_frac=flops / (tw * 1e-3) / ceil["mm_rate"],
                               wide_speedup=t / tw)
                except Exception as e:
                    rec["wide_error"] = repr(e)[:300]
                    traceback.print_exc()
            if gluon and H >= 64:
                gluon_rows(rec, sets, ceil, t, floor, flops, gluon_configs)
            rec.update(ms=t, floor_ms=floor, of_floor=floor / t,
                       tb_s=nbytes / (t * 1e-3) / 1e12, bw_frac=nbytes / (t * 1e-3) / ceil["copy_bw"],
                       tflops=flops / (t * 1e-3) / 1e12, mm_frac=flops / (t * 1e-3) / ceil["mm_rate"],
                       bound="memory" if nbytes / ceil["copy_bw"] >= flops / ceil["mm_rate"] else "compute")
            if einsum:
                try:
                    te = time_fn(einsum_mla, sets, True, warmup_ms=10, rep_ms=50)
                    rec.update(einsum_ms=te, speedup_vs_einsum=te / t)
                except torch.OutOfMemoryError:
                    rec.update(einsum_ms=None)
            del sets
        except Exception as e:
            rec["error"] = repr(e)[:300]
            traceback.print_exc()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        rows.append(rec)
        print("row", rec, flush=True)
        results["table"] = rows
    cols = [("H", "H"), ("B", "B"), ("T/rank", "T"), ("config", "cfg"), ("splits", "splits"), ("ms", "ms"), ("eager ms", "eager_ms"),
            ("floor ms", "floor_ms"), ("floor/ms", "of_floor"), ("TB/s", "tb_s"), ("% copy bw", lambda r: f"{100 * r['bw_frac']:.0f}" if "bw_frac" in r else ""),
            ("TFLOP/s", "tflops"), ("% mm rate", lambda r: f"{100 * r['mm_frac']:.0f}" if "mm_frac" in r else ""),
            ("einsum ms", lambda r: r.get("einsum_ms") or ""), ("vs einsum", lambda r: f"{r['speedup_vs_einsum']:.1f}x" if r.get("speedup_vs_einsum") else ""),
            ("wide ms", lambda r: r.get("wide_ms") or ""), ("wide floor/ms", lambda r: r.get("wide_of_floor") or ""),
            ("wide % mm rate", lambda r: f"{100 * r['wide_mm_frac']:.0f}" if "wide_mm_frac" in r else ""),
            ("wide vs split", lambda r: f"{r['wide_speedup']:.2f}x" if "wide_speedup" in r else ""),
            ("gluon ms", lambda r: r.get("gluon_ms") or ""),
            ("gluon % mm rate", lambda r: f"{100 * r['gluon_mm_frac']:.0f}" if "gluon_mm_frac" in r else ""),
            ("auto", "auto")]
    md = fmt_table(rows, cols)
    results["table_md"] = md
    print(md, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernel.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tuned-out", default=None, help="write the sweep's per-bucket choice here (DCP_MLA_TUNED format)")
    ap.add_argument("--wide-sweep", action="store_true", help="tile configs of the two-GEMM wide kernels")
    ap.add_argument("--wide-min-rows", type=int, default=64, help="time the wide path from this many heads up")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--gluon", action="store_true", help="also time the Gluon one-read kernel (kernels/gluon/lock_step.py)")
    ap.add_argument("--gluon-configs", default=None,
                    help="';'-separated Gluon configs block_h,block_n,stages,schedule,q_reg (default: GLUON_CONFIGS)")
    ap.add_argument("--gluon-splits", default=None,
                    help="comma list of split counts: time the Gluon kernel with each at --split-shapes")
    ap.add_argument("--split-shapes", default="64x8x32768,64x8x131072,128x8x32768", help="HxBxT,...")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--no-einsum", action="store_true")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", default="4096,16384,65536,131072")
    a = ap.parse_args()
    torch.manual_seed(0)
    results = dict(env=env_info())
    ceil = dict(copy_bw=copy_bandwidth(device=DEV), mm_rate=matmul_rate(device=DEV))
    results["ceilings"] = ceil
    print("ceilings: copy %.2f TB/s, bf16 matmul %.0f TFLOP/s" % (ceil["copy_bw"] / 1e12, ceil["mm_rate"] / 1e12), flush=True)
    write_json(a.out, results)
    if a.sweep:
        sweep(results, ceil, a.tuned_out)
        M._TUNED.update({int(k): tuple(v) for k, v in results["tuned"].items()})
        write_json(a.out, results)
    if a.wide_sweep:
        wide_sweep(results, ceil)
        write_json(a.out, results)
    if a.gluon_splits:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.split_shapes.split(",")]
        gluon_split_sweep(results, ceil, shapes, [int(x) for x in a.gluon_splits.split(",")])
        write_json(a.out, results)
    if not a.no_table:
        table(results, ceil, [int(x) for x in a.heads.split(",")], [int(x) for x in a.batches.split(",")],
              [int(x) for x in a.ctx.split(",")], einsum=not a.no_einsum, wide_min_rows=a.wide_min_rows, gluon=a.gluon,
              gluon_configs=a.gluon_configs.split(";") if a.gluon_configs else None)
        write_json(a.out, results)
    if a.flex:
        flex_token(results)
        write_json(a.out, results)


if __name__ == "__main__":
    main()
