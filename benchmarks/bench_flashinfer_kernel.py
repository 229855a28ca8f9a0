"""FlashInfer's MLA decode kernel beside the Gluon, split and wide kernels, kernel time only (H200).

``flashinfer_probe.py`` times FlashInfer through ``attn_backend="flashinfer"`` eagerly
(host work, counts and plan checks inside every call) against the Triton path. This times what each kernel costs in a captured decode step: FlashInfer's
``BatchMLAPagedAttentionWrapper.run`` with its ``plan`` done once per shape, outside the
timing, captured in a CUDA graph when it can be (else launched eagerly: the row says
which), and the three Triton/Gluon paths graph-timed as in ``bench_kernel.py``. Same
inputs (fused 512 + 64 bf16 cache, one query token, every row full), same ceilings.

The adapter (``attn_backend="flashinfer"``) is also timed in a captured decode step, planned
on the host from the step's count before the replays (``fi_step_*``). FlashInfer runs in two page layouts: one page per request (``page_size = T``, how the
``attn_backend="flashinfer"`` adapter hands it a dense shard) and 64-token pages in
request order (a serving engine's paged cache). Its output is checked against the fp32
reference like the others (rel. error of batch row 0, LSE in base 2).

    source benchmarks/flashinfer_env.sh && python3 benchmarks/bench_flashinfer_kernel.py \
        --out $OUT/flashinfer_kernel_h200.json        # vendor/flashinfer carried
    ... --paths gluon_seesaw,gluon,wide,split --fi-pages T --shapes <18 shapes> \
        --out $OUT/kernel_paths_h200.json             # the path table's bf16 source (make_path_table.py)

``--paths`` names our kernels (``gluon``: the default Gluon config's, or registry kernel names);
``--no-flashinfer`` times only those.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import check, counts, graph_of, make_case, time_triton  # noqa: E402
from common import (KV_LORA, SCALE, bench, copy_bandwidth, env_info, floor_ms, fmt_table, matmul_rate,  # noqa: E402
                    write_json)

from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels.reference import attention_impl  # noqa: E402

SHAPES = "64x8x32768,64x8x131072,64x32x32768,64x32x131072,128x8x32768,128x8x131072,128x32x32768,128x32x131072"


def flashinfer_call(q, kv, page_size):
    """(run, planned wrapper) for FlashInfer's fa3 MLA decode over the fused cache ``kv``
    seen as its latent and rope parts, pages of ``page_size`` tokens in request order."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    B, _, H, _ = q.shape
    T = kv.shape[1]
    dev = q.device
    q_nope, q_pe = q[:, 0, :, :KV_LORA].contiguous(), q[:, 0, :, KV_LORA:].contiguous()
    per_row = T // page_size
    # views of the fused cache: page p of row b starts at token (p % per_row) * page_size
    ckv = kv[..., :KV_LORA].unflatten(1, (per_row, page_size)).flatten(0, 1)
    kpe = kv[..., KV_LORA:].unflatten(1, (per_row, page_size)).flatten(0, 1)
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend="fa3")
    # plan() takes host tensors (its probe use, benchmarks/flashinfer_probe.py) and copies them over
    qo_indptr = torch.arange(B + 1, dtype=torch.int32)
    kv_indptr = torch.arange(B + 1, dtype=torch.int32) * per_row
    kv_indices = torch.arange(B * per_row, dtype=torch.int32)
    kv_len = torch.full((B,), T, dtype=torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, H, KV_LORA, kv.shape[-1] - KV_LORA, page_size, False,
                 SCALE, q.dtype, kv.dtype)
    out = torch.empty(B, H, KV_LORA, dtype=q.dtype, device=dev)
    lse = torch.empty(B, H, dtype=torch.float32, device=dev)

    def run():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)
        return out, lse

    return run


def step_rows(rec, sets, flops, ceil, floor):
    """``attn_backend="flashinfer"`` through the adapter in a captured decode step: the device
    count is the step's, known on the host (``host_lens``), planned before the replays
    (runtime/decode/step_count.py), empty-row fix-up and base conversion included: what an
    int-position decode graph replays. Timed as the Triton paths (one call per input set)."""
    from dcp_pass.runtime.decode import step_count
    from dcp_pass.runtime.decode.backends import attend

    q0, kv0 = sets[0]
    T = kv0.shape[1]
    lens = torch.full((1,), T, dtype=torch.int64, device=q0.device)
    outs = []

    def call(q, kv):
        out = attend(AttentionCall(q, None, kv, None, KV_LORA, SCALE, kv_lens=lens, host_lens=T), "flashinfer")
        outs.append(out)
        return out

    try:
        plans = step_count.HostPlans()
        with step_count.step(plans, T):
            replay = graph_of([(lambda q=q, kv=kv: call(q, kv)) for q, kv in sets])
        o, lse = outs[-len(sets)]  # the captured call of set 0
        with step_count.step(plans, T):
            replay()
        torch.cuda.synchronize()
        ro, rl = attention_impl(AttentionCall(q0[:1], None, kv0[:1], None, KV_LORA, SCALE), torch.float32)
        rec["fi_step_rel_err"] = ((o[:1].float() - ro).norm() / ro.norm()).item()
        rec["fi_step_lse_err"] = (lse[:1] - rl).abs().max().item()
        with step_count.step(plans, T):
            t = bench(replay) / len(sets)
        rec.update(fi_step_ms=t, fi_step_mm_frac=flops / (t * 1e-3) / ceil["mm_rate"], fi_step_of_floor=floor / t,
                   fi_step_planners=len(plans))
    except Exception as e:  # noqa: BLE001
        rec["fi_step_error"] = f"{type(e).__name__}: {e}"[-600:]
        traceback.print_exc()


def flashinfer_rows(rec, sets, flops, ceil, floor, pages=("T", "64")):
    q, kv = sets[0]
    ro, rl = attention_impl(AttentionCall(q[:1], None, kv[:1], None, KV_LORA, SCALE), torch.float32)
    for page_size in [kv.shape[1] if p == "T" else int(p) for p in pages]:
        tag = "fi_page_T" if page_size == kv.shape[1] else f"fi_page_{page_size}"
        try:
            run = flashinfer_call(q, kv, page_size)
            o, lse = run()
            torch.cuda.synchronize()
            rec[f"{tag}_rel_err"] = ((o[:1].float() - ro[:, 0]).norm() / ro[:, 0].norm()).item()
            rec[f"{tag}_lse_err"] = (lse[:1] - rl[:, 0] / math.log(2)).abs().max().item()
            try:
                t = bench(graph_of([run]))
                rec[f"{tag}_timing"] = "graph"
            except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly
                rec[f"{tag}_graph_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
                t = bench(run)
                rec[f"{tag}_timing"] = "eager"
            rec[f"{tag}_ms"] = t
            rec[f"{tag}_mm_frac"] = flops / (t * 1e-3) / ceil["mm_rate"]
            rec[f"{tag}_of_floor"] = floor / t
        except Exception as e:  # noqa: BLE001
            rec[f"{tag}_error"] = f"{type(e).__name__}: {e}"[-600:]
            traceback.print_exc()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/flashinfer_kernel_h200.json")
    ap.add_argument("--shapes", default=SHAPES, help="HxBxT,...")
    ap.add_argument("--fi-pages", default="T,64", help="FlashInfer's page layouts: T (one page per row), sizes")
    ap.add_argument("--no-step", action="store_true", help="skip the adapter's captured-step rows")
    ap.add_argument("--paths", default="gluon,wide,split",
                    help="our kernels to time beside FlashInfer: gluon (the default Gluon config's kernel) or registry "
                         "kernel names (gluon_seesaw, gluon_roles, wide, split, ...)")
    ap.add_argument("--no-flashinfer", action="store_true", help="our kernels only (no flashinfer import)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (and flashinfer: source benchmarks/flashinfer_env.sh)")
    if a.no_flashinfer:
        version = None
    else:
        import flashinfer

        version = flashinfer.__version__
    paths = [p for p in a.paths.split(",") if p]
    torch.manual_seed(0)
    results = dict(env=env_info(), flashinfer=version, paths=paths)
    ceil = dict(copy_bw=copy_bandwidth(), mm_rate=matmul_rate())
    results["ceilings"] = ceil
    rows = results["rows"] = []
    for sh in a.shapes.split(","):
        H, B, T = (int(x) for x in sh.split("x"))
        sets = make_case(B, 1, H, T)
        nbytes, flops = counts(B, 1, H, T)
        floor = floor_ms(nbytes, flops, ceil)
        rec = dict(H=H, B=B, T=T, floor_ms=floor)
        for path in paths:
            try:
                rec[f"{path}_rel_err"], rec[f"{path}_lse_err"] = check(sets, path)
                t = time_triton(sets, path=path)
                rec.update({f"{path}_ms": t, f"{path}_mm_frac": flops / (t * 1e-3) / ceil["mm_rate"],
                            f"{path}_of_floor": floor / t})
            except Exception as e:  # noqa: BLE001
                rec[f"{path}_error"] = f"{type(e).__name__}: {e}"[-600:]
        if not a.no_flashinfer:
            flashinfer_rows(rec, sets, flops, ceil, floor, a.fi_pages.split(","))
            if not a.no_step:
                step_rows(rec, sets, flops, ceil, floor)
        fi = [rec[k] for k in ("fi_page_T_ms", "fi_page_64_ms") if k in rec]
        for path in paths:
            if fi and f"{path}_ms" in rec:
                rec[f"{path}_vs_best_flashinfer"] = min(fi) / rec[f"{path}_ms"]
        rows.append(rec)
        print("row", rec, flush=True)
        write_json(a.out, results)
        del sets
        torch.cuda.empty_cache()
    cols = [("H", "H"), ("B", "B"), ("T", "T")]
    for path in paths:
        cols += [(f"{path} ms", f"{path}_ms"), (f"{path} mm frac", f"{path}_mm_frac"),
                 (f"{path} floor/ms", f"{path}_of_floor"), (f"best FlashInfer / {path}", f"{path}_vs_best_flashinfer"),
                 (f"{path} rel err", f"{path}_rel_err")]
    cols += [("FlashInfer page=T ms", "fi_page_T_ms"), ("timed", "fi_page_T_timing"),
             ("FlashInfer page=64 ms", "fi_page_64_ms"), ("timed", "fi_page_64_timing"),
             ("adapter, captured step ms", "fi_step_ms"), ("adapter rel err", "fi_step_rel_err"),
             ("FlashInfer rel err", "fi_page_64_rel_err")]
    results["table_md"] = fmt_table(rows, cols)
    write_json(a.out, results)
    print(results["table_md"])


if __name__ == "__main__":
    main()
