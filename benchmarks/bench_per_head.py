"""Per-head (GQA) decode attention: the per-head split-KV kernel against torch's fused SDPA
kernels with a log-sum-exp, and against the copy ceiling measured in the same run.

A Llama-8B-shaped layer (32 query heads, 8 kv heads, head dim 128), bf16, one decode token,
B=8, 16K and 64K keys. The caches are stored as Hugging Face's static cache holds them,
[B, Hk, T, D]; the kernel reads them through the op's [B, T, Hk, D] view with device key
counts (a static-shape decode step). Peers, each on the same storage, each returning its LSE:

* ``flash_fwd``: ``aten._flash_attention_forward`` (FlashAttention-2, native GQA: 32 query
  heads over the 8 kv heads, its own split-KV heuristic; torch 2.11 takes no ``num_splits``);
* ``sdpa_flash`` / ``sdpa_efficient`` / ``sdpa_cudnn``: ``aten._scaled_dot_product_*`` with
  the group's query heads packed as query tokens ([B, Hk, G, D]: each kv head read once).

FlashInfer's batch decode is not here: it is not installed on the device machines, and its
wheel with its JIT cache is too large to carry there.

Every time is the median of ``triton.testing.do_bench`` over CUDA-graph replays (launch gaps
out of the numbers), in alternating passes over the paths (their spread is the noise; the
median pass is kept); the kernel's eager time through ``backends.attend`` (its Python path) is
reported beside. ``of_copy``: KV bytes / time over the measured copy bandwidth (bytes read +
written by a 2 GiB device-to-device copy). Correctness: the kernel's output and LSE against
the fp32 torch reference of the same call, and every peer against it.

    python benchmarks/bench_per_head.py --out benchmarks/results/per_head_h100.json [--sweep]
    python benchmarks/bench_per_head.py --layers 32/8/64/64,32/8/192/128,32/8/128/256,16/16/192/128 --keys 16384
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench, copy_bandwidth, env_info, fmt_table, graph_of, write_json  # noqa: E402

from dcp_pass.runtime.decode.backends import attend_with_kernel  # noqa: E402
from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels import per_head_attention as ph  # noqa: E402
from dcp_pass.runtime.decode.kernels.reference import attention_impl  # noqa: E402

LOG2E = 1.4426950408889634


def make(B, H, Hk, D, Dv, T, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(1234 + T)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dtype, generator=g)
    k_store = torch.randn(B, Hk, T, D, device="cuda", dtype=dtype, generator=g)
    v_store = torch.randn(B, Hk, T, Dv, device="cuda", dtype=dtype, generator=g)
    lens = torch.full((B,), T, device="cuda", dtype=torch.int64)
    return q, k_store, v_store, lens


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def peers(q, k_store, v_store, scale):
    """name -> fn() returning (out [B, 1, H, Dv], lse_e [B, 1, H]) of each peer on the same storage."""
    B, _, H, D = q.shape
    Dv = v_store.shape[-1]
    Hk, T = k_store.shape[1], k_store.shape[2]
    G = H // Hk
    k_bthd, v_bthd = k_store.transpose(1, 2), v_store.transpose(1, 2)
    q_packed = q.view(B, H, D).view(B, Hk, G, D)  # the group's heads as query tokens

    def unpack(o, lse):  # [B, Hk, G, Dv], [B, Hk, G] -> [B, 1, H, Dv], [B, 1, H]
        return o.reshape(B, 1, H, Dv), lse.reshape(B, 1, H)

    def flash_fwd():
        o, lse = torch.ops.aten._flash_attention_forward(q, k_bthd, v_bthd, None, None, 1, T, 0.0, False, False,
                                                          scale=scale)[:2]
        return o, lse.reshape(B, H, 1).transpose(1, 2)

    def sdpa_flash():
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q_packed, k_store, v_store, 0.0, False, False,
                                                                     scale=scale)[:2]
        return unpack(o, lse)

    def sdpa_efficient():
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q_packed, k_store, v_store, None, True, 0.0,
                                                                         False, scale=scale)[:2]
        return unpack(o, lse[..., :G])

    def sdpa_cudnn():
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q_packed, k_store, v_store, None, True, 0.0, False,
                                                                     False, scale=scale)[:2]
        return unpack(o, lse.reshape(B, Hk, G))

    return {"flash_fwd": flash_fwd, "sdpa_flash": sdpa_flash, "sdpa_efficient": sdpa_efficient,
            "sdpa_cudnn": sdpa_cudnn}


def timed_graph(fn):
    fn()
    torch.cuda.synchronize()
    return bench(graph_of([fn]))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def one_shape(B, H, Hk, D, Dv, T, copy_bw, sweep, passes):
    q, k_store, v_store, lens = make(B, H, Hk, D, Dv, T)
    scale = D ** -0.5
    call = AttentionCall(q, None, k_store.transpose(1, 2), None, Dv, scale, v=v_store.transpose(1, 2), kv_lens=lens)
    kv_bytes = B * Hk * T * (D + Dv) * k_store.element_size()
    rows = []

    def record(path, t, **extra):
        r = dict(B=B, H=H, Hk=Hk, D=D, Dv=Dv, T=T, path=path, ms=round(t, 4), kv_bytes=kv_bytes,
                 tb_s=round(kv_bytes / (t * 1e-3) / 1e12, 3), of_copy=round(kv_bytes / (t * 1e-3) / copy_bw, 3),
                 **extra)
        rows.append(r)
        print("row", r, flush=True)

    ro, rl = attention_impl(call, torch.float32)  # fp32 reference, lse base e
    (o, lse), kernel = attend_with_kernel(call, "auto")
    assert kernel.name == "per_head", kernel.name
    errs = {"per_head": (rel(o, ro), (lse.double() - rl.double()).abs().max().item())}
    assert errs["per_head"][0] < 2e-2 and errs["per_head"][1] < 2e-2, errs
    paths = {"per_head": lambda: attend_with_kernel(call, "per_head")}
    for name, fn in peers(q, k_store, v_store, scale).items():
        try:
            po, pl = fn()
            errs[name] = (rel(po, ro), (pl.double() - rl.double()).abs().max().item())
            paths[name] = fn
        except Exception as e:  # noqa: BLE001 - a peer this torch or card lacks: said in the results
            rows.append(dict(B=B, H=H, Hk=Hk, D=D, Dv=Dv, T=T, path=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print("peer", name, "failed:", rows[-1]["error"], flush=True)
    replays = {name: graph_of([fn]) for name, fn in paths.items()}
    times = {name: [] for name in paths}
    for _ in range(passes):  # alternating passes: the spread of one path's times is the noise
        for name, replay in replays.items():
            times[name].append(bench(replay))
    cfg = ph.pick_config(H // Hk, D, Dv, B, Hk, T, q.device)
    for name, ts in times.items():
        record(name, median(ts), ms_passes=[round(t, 4) for t in ts], err_out=errs[name][0], err_lse=errs[name][1],
               **({"config": str(cfg)} if name == "per_head" else {}))
    record("per_head eager", bench(paths["per_head"]))
    del replays

    if sweep:
        for bn in (32, 64, 128):
            for warps in ((4, 8) if bn == 128 else (4,)):
                for stages in (2, 3, 4):
                    for ns in (4, 8, 16, 32):
                        c = ph.PerHeadConfig(16, bn, warps, stages, ns)
                        try:
                            t = timed_graph(lambda c=c: attend_with_kernel(call, "per_head", config=c))
                            record("sweep", t, config=f"{bn},{warps},{stages},{ns}")
                        except Exception as e:  # noqa: BLE001 - out of shared memory
                            print("sweep", c, "failed:", type(e).__name__, str(e)[:120], flush=True)
    del q, k_store, v_store
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/per_head.json")
    ap.add_argument("--keys", default="16384,65536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", default="32/8/128/128", help="H/Hk/D/Dv,... (default: Llama-8B's)")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles and split counts too")
    ap.add_argument("--passes", type=int, default=3, help="alternating timing passes over the paths")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    results = dict(env=env_info())
    copy_bw = copy_bandwidth()
    results["copy_bw"] = copy_bw
    print(f"copy ceiling {copy_bw / 1e12:.3f} TB/s (read + write)", flush=True)
    rows = []
    for layer in args.layers.split(","):
        H, Hk, D, Dv = (int(x) for x in layer.split("/"))
        for T in (int(x) for x in args.keys.split(",")):
            rows += one_shape(args.batch, H, Hk, D, Dv, T, copy_bw, args.sweep, args.passes)
            results["rows"] = rows
            write_json(args.out, results)
    summary = []
    for key in sorted({(r["H"], r["Hk"], r["D"], r["Dv"], r["T"]) for r in rows}):
        at = [r for r in rows if (r["H"], r["Hk"], r["D"], r["Dv"], r["T"]) == key and "ms" in r]
        H, Hk, D, Dv, T = key
        ours = next(r for r in at if r["path"] == "per_head")
        peer = [r for r in at if r["path"] not in ("per_head", "per_head eager", "sweep")]
        best = min(peer, key=lambda r: r["ms"]) if peer else None
        summary.append(dict(H=H, Hk=Hk, D=D, Dv=Dv, T=T, per_head_ms=ours["ms"], of_copy=ours["of_copy"],
                            best_peer=best["path"] if best else "", best_peer_ms=best["ms"] if best else None,
                            vs_best_peer=round(best["ms"] / ours["ms"], 3) if best else None))
        sw = [r for r in at if r["path"] == "sweep"]
        if sw:
            summary[-1]["best_sweep"] = min(sw, key=lambda r: r["ms"])["config"]
            summary[-1]["best_sweep_ms"] = min(r["ms"] for r in sw)
    results["summary"] = summary
    results["table_md"] = fmt_table([r for r in rows if r["path"] != "sweep" and "ms" in r],
                                    [("H/Hk", lambda r: f"{r['H']}/{r['Hk']}"), ("D/Dv", lambda r: f"{r['D']}/{r['Dv']}"),
                                     ("T", "T"), ("path", "path"), ("ms", "ms"), ("TB/s", "tb_s"),
                                     ("of copy", "of_copy"), ("passes ms", lambda r: " / ".join(
                                         f"{t:.3f}" for t in r.get("ms_passes", []))), ("rel err out", "err_out")])
    write_json(args.out, results)
    print(results["table_md"])
    print(summary, flush=True)


if __name__ == "__main__":
    main()
