"""Where the warp-specialised Gluon kernel's time goes, tile by tile (H200 probe).

Runs ``mla_gluon_ws`` with its TRACE hook on: each warpgroup stamps the SM's cycle counter at
eight points of every own tile (loop top, the next own tile landed, scores and row max
done, max handed on, probabilities published, the other's value GEMM done, own value GEMM
done, refill issued). Prints the median cycles of each phase over all programs and steady-state tiles,
and one program's first tiles as a timeline; writes both as JSON.

    python benchmarks/probe_gluon_ws_trace.py --shapes 64x8x32768,128x8x32768 --config 64,32,4,9,0
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_kernel import make_case, time_triton  # noqa: E402
from common import SCALE, env_info, write_json  # noqa: E402

from dcp_pass.runtime.decode.kernels import mla_attention as M  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_gluon as G  # noqa: E402
from dcp_pass.runtime.decode.kernels.splits import split_count  # noqa: E402

EVENTS = ("top", "next_landed", "scores", "max_out", "p_out", "remote_pv", "own_pv", "refilled")
PHASES = (("wait scores + row max", 0, 2), ("max hand-over", 2, 3), ("softmax + publish", 3, 4),
          ("other's P @ V", 4, 5), ("own P @ V + next scores issued", 5, 6), ("refill", 6, 7))


def traced(q, kv, cfg):
    B, S, H, _ = q.shape
    n_hb = -(-S * H // cfg.block_h)
    ns = split_count(B, n_hb, kv.shape[1], kv.device, cfg.waves)
    tr = torch.zeros(B * ns * n_hb * 1024, dtype=torch.int64, device=q.device)
    G.WS_TRACE[:] = [tr]
    try:
        M.mla_attention_triton(q, None, kv, None, 512, SCALE, None, None, path="gluon", config=cfg)
        torch.cuda.synchronize()
    finally:
        G.WS_TRACE.clear()
    n_tiles = -(-kv.shape[1] // ns // cfg.block_n)
    return tr.view(B * ns * n_hb, 2, 64, 8).cpu(), n_tiles


def phases(tr, n_tiles):
    """Median cycles of each phase (steady state: own tiles 2.. of each warpgroup), and the
    median cycles per tile of the whole loop."""
    out = {name: [] for name, _, _ in PHASES}
    per_tile = []
    for prog in tr:
        own = [(n_tiles - w + 1) // 2 for w in (0, 1)]
        for w in (0, 1):
            rows = prog[w, : min(own[w], 64)]
            for i in range(2, len(rows)):
                r = rows[i].tolist()
                for name, a, b in PHASES:
                    if name == "other's P @ V" and w == 0 and i == 0:
                        continue
                    out[name].append(r[b] - r[a])
            if len(rows) > 3:
                per_tile.append((rows[-1, 7] - rows[1, 0]).item() / (2 * (len(rows) - 2)))
    return {k: statistics.median(v) for k, v in out.items() if v}, statistics.median(per_tile)


def timeline(prog, tiles=8):
    t0 = min(prog[w, 0, 0].item() for w in (0, 1))
    rows = []
    for j in range(tiles):
        w, i = j % 2, j // 2
        rows.append(dict(tile=j, wg=w, **{e: prog[w, i, k].item() - t0 for k, e in enumerate(EVENTS)}))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x8x32768,128x8x32768")
    ap.add_argument("--config", default="64,32,4,9,0")
    ap.add_argument("--out", default="benchmarks/results/gluon_ws_trace.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cfg = G.GluonConfig.parse(a.config)
    res = dict(env=env_info(), config=cfg.tag(), events=EVENTS, shapes=[])
    for sh in a.shapes.split(","):
        H, B, T = (int(x) for x in sh.split("x"))
        sets = make_case(B, 1, H, T)
        q, kv = sets[0]
        traced(q, kv, cfg)  # compile
        tr, n_tiles = traced(q, kv, cfg)
        med, per_tile = phases(tr, n_tiles)
        plain = time_triton(sets, cfg, path="gluon")
        G.WS_TRACE[:] = [torch.zeros(1 << 24, dtype=torch.int64, device="cuda")]
        try:
            with_trace = time_triton(sets, cfg, path="gluon")
        finally:
            G.WS_TRACE.clear()
        rec = dict(H=H, B=B, T=T, tiles_per_split=n_tiles, phase_median_cycles=med, cycles_per_tile=per_tile,
                   ms=plain, ms_traced=with_trace, timeline=timeline(tr[0]))
        res["shapes"].append(rec)
        print(f"{sh}: {plain:.4f} ms ({with_trace:.4f} traced), {n_tiles} tiles per split, "
              f"{per_tile:.0f} cycles per tile", flush=True)
        for k, v in med.items():
            print(f"   {k:22s} {v:8.0f}")
        for r in rec["timeline"]:
            print("   " + " ".join(f"{k}={v}" for k, v in r.items()))
        write_json(a.out, res)


if __name__ == "__main__":
    main()
