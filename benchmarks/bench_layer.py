"""One absorbed-MLA layer decode step with DCP, built from the runtime pieces.

Every rank runs the layer's TP-local part (q path, latent KV write, attention, w_vc,
o_proj + TP all-reduce). With DCP = c, the c consecutive attention-TP ranks of a DCP
group stripe the KV cache (rank r keeps positions p % c == r at row p // c), attend
with the query heads of the whole group over their own stripe, and exchange/merge the
partials (dcp_pass.runtime.decode.comm) back to their TP-local heads:

  a2a_gq   query all-gather + packed all-to-all (the a2a exchange after a query all-gather)
  a2a_rq   q-proj / w_kc replicated: one packed all-to-all ("a2a, replicated Q")
  ag_rs    query all-gather + LSE all-gather + fp32 reduce-scatter

    # GPU table (NCCL, one process per GPU):
    python benchmarks/bench_layer.py --world 2 --tp 2 --dcp 1,2 --out results.json
    # correctness of the DCP step against a single-process reference (CPU, gloo):
    python benchmarks/bench_layer.py --check --device cpu --world 4 --tp 4 --dcp 1,2,4

The same script with --world 4/8 --tp 4/8 --dcp 1,2,4,8 makes the scaling table
(benchmarks/run_scaling.sh).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (HIDDEN, KV_LORA, N_HEADS, N_LAYERS, NO_MULTICAST_ENV, Q_LORA, QK_NOPE, ROOT, ROPE,  # noqa: E402
                    V_HEAD, env_info, floor_ms, fmt_table, write_json)

REAL = dict(hidden=HIDDEN, q_lora=Q_LORA, heads=N_HEADS, kv_lora=KV_LORA, rope=ROPE, nope=QK_NOPE, v_head=V_HEAD)
SMALL = dict(hidden=64, q_lora=32, heads=16, kv_lora=32, rope=8, nope=16, v_head=16)


# ----------------------------------------------------------------------------- helpers
def rmsnorm(x, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def full_weights(dims, device, dtype, seed=1234):
    """The layer's unsharded weights, identical on every rank (fixed draw order)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    H, hid, ql, kvl, rope, nope, vh = (dims[k] for k in ("heads", "hidden", "q_lora", "kv_lora", "rope", "nope", "v_head"))

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)

    return dict(
        wq_a=rnd(ql, hid, fan_in=hid),
        wq_b=rnd(H * (nope + rope), ql, fan_in=ql),
        wkv_a=rnd(kvl + rope, hid, fan_in=hid),
        w_kc=rnd(H, nope, kvl, fan_in=nope),
        w_vc=rnd(H, kvl, vh, fan_in=kvl),
        wo=rnd(hid, H * vh, fan_in=H * vh),
    )


def head_rows(w, heads, per_head):
    """Rows of a [H * per_head, K] projection for the given head range."""
    return w[heads.start * per_head: heads.stop * per_head]


class Topo:
    """Attention-TP groups of size tp; DCP groups = c consecutive ranks inside one TP group."""

    def __init__(self, rank, world, tp, c, groups):
        assert world % tp == 0 and tp % c == 0, (world, tp, c)
        self.rank, self.tp, self.c = rank, tp, c
        self.tp_rank = rank % tp
        self.tp_base = rank - self.tp_rank
        self.dcp_rank = self.tp_rank % c  # topology.py: dcp_rank == attn_tp_rank % dcp_size
        self.dcp_index = self.tp_rank // c
        self.tp_group = groups[("tp", tuple(range(self.tp_base, self.tp_base + tp)))]
        dcp_ranks = tuple(range(self.tp_base + self.dcp_index * c, self.tp_base + (self.dcp_index + 1) * c))
        self.dcp_group = groups[("dcp", dcp_ranks)] if c > 1 else None


def make_groups(world, tp, cs):
    """Create every TP and DCP group (new_group is collective: all ranks, same order)."""
    import torch.distributed as dist

    groups = {}
    for base in range(0, world, tp):
        ranks = tuple(range(base, base + tp))
        groups[("tp", ranks)] = dist.new_group(list(ranks)) if tp < world else dist.group.WORLD
        for c in sorted(set(cs)):
            if c == 1:
                continue
            for j in range(tp // c):
                sub = tuple(range(base + j * c, base + (j + 1) * c))
                if ("dcp", sub) not in groups:
                    groups[("dcp", sub)] = dist.new_group(list(sub)) if len(sub) < world else dist.group.WORLD
    return groups


def group_name(pg):
    return pg.group_name


# ----------------------------------------------------------------------------- the layer
# benchmark variant -> comm backend (a name of dcp_pass.runtime.decode.backends.COMM_BACKENDS)
COMM_OF_VARIANT = {"a2a_rq": "a2a", "a2a_gq": "a2a", "ag_rs": "ag_rs"}


class Layer:
    """One rank's part of the MLA layer for one (c, comm) setting."""

    def __init__(self, W, dims, topo: Topo, comm, B, L, device, dtype, fill="random", full_cache=None):
        from dcp_pass.runtime.decode import layout

        self.dims, self.topo, self.comm, self.B, self.L = dims, topo, comm, B, L
        H, nope, rope, kvl, vh = (dims[k] for k in ("heads", "nope", "rope", "kv_lora", "v_head"))
        tp, c = topo.tp, topo.c
        self.h_loc = H // tp
        loc = range(topo.tp_rank * self.h_loc, (topo.tp_rank + 1) * self.h_loc)
        grp = range(topo.dcp_index * c * self.h_loc, (topo.dcp_index + 1) * c * self.h_loc)
        self.replicated_q = c > 1 and comm == "a2a_rq"
        qh = grp if self.replicated_q else loc
        self.hq = len(qh)
        self.wq_a = W["wq_a"]
        self.wq_b = head_rows(W["wq_b"], qh, nope + rope).contiguous()
        self.w_kc = W["w_kc"][qh.start:qh.stop].contiguous()
        self.wkv_a = W["wkv_a"]
        self.w_vc = W["w_vc"][loc.start:loc.stop].contiguous()
        self.wo = W["wo"][:, loc.start * vh:loc.stop * vh].contiguous()
        self.scale = (nope + rope) ** -0.5
        D = kvl + rope
        # local cache: capacity for L + 1 tokens, plus one scratch row that non-owners write
        self.t_cap = layout.local_capacity(L + 1, c)
        self.cache = torch.empty(B, self.t_cap + 1, D, device=device, dtype=dtype)
        if full_cache is not None:  # check mode: stripe of a known full cache
            self.cache.zero_()
            mine = full_cache[:, topo.dcp_rank:L:c]
            self.cache[:, : mine.shape[1]] = mine
        else:
            self.cache.normal_()
        self.pos = torch.full((B,), L, dtype=torch.long, device=device)  # position of the new token
        self.barange = torch.arange(B, device=device)
        self.x = torch.randn(B, 1, dims["hidden"], device=device, dtype=dtype)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in
                                (self.wq_a, self.wq_b, self.w_kc, self.wkv_a, self.w_vc, self.wo))
        self.gemm_flops = 2 * B * sum(t.numel() for t in (self.wq_a, self.wq_b, self.w_kc, self.wkv_a, self.w_vc, self.wo))
        self.local_len_after = layout.local_length(L + 1, c, topo.dcp_rank)

    # pieces, so that the benchmark can time them alone
    def q_path(self, x):
        from dcp_pass.runtime.decode.comm import gather_heads

        d = self.dims
        B = x.shape[0]
        ql = rmsnorm(x @ self.wq_a.t())
        q = (ql @ self.wq_b.t()).view(B, 1, self.hq, d["nope"] + d["rope"])
        q_nope, q_pe = q.split([d["nope"], d["rope"]], dim=-1)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, self.w_kc)
        qf = torch.cat([q_lat, q_pe], dim=-1)
        if self.topo.c > 1 and not self.replicated_q:
            qf = gather_heads(qf, group_name(self.topo.dcp_group), self.topo.c)
        return qf

    def kv_write(self, x):
        from dcp_pass.runtime.decode import layout

        d, c, r = self.dims, self.topo.c, self.topo.dcp_rank
        kvn = x[:, 0] @ self.wkv_a.t()
        kvn = torch.cat([rmsnorm(kvn[:, : d["kv_lora"]]), kvn[:, d["kv_lora"]:]], dim=-1)
        own = layout.owner(self.pos, c) == r
        slot = torch.where(own, layout.physical(self.pos, c), torch.full_like(self.pos, self.t_cap))
        self.cache[self.barange, slot] = kvn
        return layout.local_length(self.pos + 1, c, r)

    def attend(self, qf, kv_lens):
        from dcp_pass.runtime.decode.backends import attend
        from dcp_pass.runtime.decode.call import AttentionCall

        # None: the Triton kernels on CUDA, the torch reference elsewhere (runtime/decode/backends.py);
        # kv_lens are this rank's own counts here (stripe (1, 0))
        return attend(AttentionCall(qf, None, self.cache, None, self.dims["kv_lora"], self.scale, kv_lens=kv_lens), None)

    def exchange(self, o, lse):
        from dcp_pass.runtime.decode.backends import COMM_BACKENDS

        c = self.topo.c
        if c == 1:
            return o
        gn = group_name(self.topo.dcp_group)
        return COMM_BACKENDS[COMM_OF_VARIANT[self.comm]].exchange(o, lse, gn, c, "e")

    def out_path(self, o):
        B = o.shape[0]
        y = torch.einsum("bshc,hcd->bshd", o, self.w_vc).reshape(B, 1, -1) @ self.wo.t()
        if self.topo.tp > 1:
            fc = torch.ops._c10d_functional
            y = fc.wait_tensor(fc.all_reduce(y.contiguous(), "sum", group_name(self.topo.tp_group)))
        return y

    def step(self, x=None):
        x = self.x if x is None else x
        qf = self.q_path(x)
        kv_lens = self.kv_write(x)
        o, lse = self.attend(qf, kv_lens)
        return self.out_path(self.exchange(o, lse))


def reference_output(W, dims, x, full_cache, L):
    """Single-process float32 reference of the whole layer (all heads, unsharded cache)."""
    d = dims
    Wf = {k: v.float() for k, v in W.items()}
    xf = x.float()
    B = x.shape[0]
    ql = rmsnorm(xf @ Wf["wq_a"].t())
    q = (ql @ Wf["wq_b"].t()).view(B, 1, d["heads"], d["nope"] + d["rope"])
    q_nope, q_pe = q.split([d["nope"], d["rope"]], dim=-1)
    q_lat = torch.einsum("bshd,hdc->bshc", q_nope, Wf["w_kc"])
    kvn = xf[:, 0] @ Wf["wkv_a"].t()
    kvn = torch.cat([rmsnorm(kvn[:, : d["kv_lora"]]), kvn[:, d["kv_lora"]:]], dim=-1)
    kv = torch.cat([full_cache[:, :L].float(), kvn.unsqueeze(1)], dim=1)  # [B, L + 1, D]
    scores = (torch.einsum("bshc,btc->bsht", q_lat, kv[..., : d["kv_lora"]])
              + torch.einsum("bshr,btr->bsht", q_pe, kv[..., d["kv_lora"]:])) * (d["nope"] + d["rope"]) ** -0.5
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bsht,btc->bshc", p, kv[..., : d["kv_lora"]])
    return torch.einsum("bshc,hcd->bshd", o, Wf["w_vc"]).reshape(B, 1, -1) @ Wf["wo"].t()


# ----------------------------------------------------------------------------- timing
def cuda_graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_ms(fn, iters, warmup=3):
    """Median per-call ms on this rank, ranks started together (barrier) each round."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def ceilings(device):
    from common import copy_bandwidth, matmul_rate

    return dict(copy_bw=copy_bandwidth(1 << 30, device="cuda"), mm_rate=matmul_rate(8192, device="cuda"))


# ----------------------------------------------------------------------------- worker
def worker(rank, world, cfg):
    import torch.distributed as dist

    if cfg.get("tuned"):
        os.environ["DCP_MLA_TUNED"] = cfg["tuned"]
    sys.path.insert(0, ROOT)
    device = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if cfg["device"] == "cuda" else torch.float32
    dims = SMALL if cfg["small"] else REAL
    tp = cfg["tp"]
    groups = make_groups(world, tp, cfg["dcp"])
    W = full_weights(dims, device, dtype)
    out = dict(rank=rank, rows=[], ceil=None)
    if cfg["device"] == "cuda" and not cfg["check"]:
        out["ceil"] = ceilings(device)
        out["mem_total"] = torch.cuda.get_device_properties(device).total_memory
    combos = []
    for c in cfg["dcp"]:
        for comm in (["none"] if c == 1 else cfg["comm"]):
            combos.append((c, comm))
    for (c, comm), B, L in itertools.product(combos, cfg["batch"], cfg["ctx"]):
        rec = dict(c=c, comm=comm, B=B, L=L, tp=tp, world=world)
        try:
            topo = Topo(rank, world, tp, c, groups)
            full = None
            if cfg["check"]:
                g = torch.Generator(device=device)
                g.manual_seed(99 + L)
                full = torch.randn(B, L, dims["kv_lora"] + dims["rope"], generator=g, device=device).to(dtype)
            lay = Layer(W, dims, topo, comm, B, L, device, dtype, full_cache=full)
            if cfg["check"]:
                gx = torch.Generator(device=device)
                gx.manual_seed(7 + B)
                x = torch.randn(B, 1, dims["hidden"], generator=gx, device=device).to(dtype)
                y = lay.step(x)
                ref = reference_output(W, dims, x, full, L)
                rec["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                rec["kv_rows_local"] = int(lay.local_len_after)
            else:
                rec.update(run_timings(lay, cfg, rank))
            del lay
        except Exception as e:  # noqa: BLE001 - record and continue
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            rec["trace"] = traceback.format_exc()[-1500:]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
        out["rows"].append(rec)
        if rank == 0:
            print("layer", {k: v for k, v in rec.items() if k != "trace"}, flush=True)
    return out


def run_timings(lay: Layer, cfg, rank):
    d = lay.dims
    it = cfg["iters"]
    rec = {}
    B, c = lay.B, lay.topo.c
    D = d["kv_lora"] + d["rope"]
    rec["kv_bytes_rank"] = int(lay.local_len_after) * B * D * 2  # one layer
    rec["heads_attended"] = lay.hq * (c if (c > 1 and not lay.replicated_q) else 1)
    attn_flops = 2 * B * rec["heads_attended"] * int(lay.local_len_after) * (D + d["kv_lora"])
    rec["flops"] = lay.gemm_flops + attn_flops
    rec["bytes"] = lay.weight_bytes + rec["kv_bytes_rank"]
    if "eager" in cfg["modes"]:
        rec["eager_ms"] = time_ms(lambda: lay.step(), it)
    if "graph" in cfg["modes"]:
        try:
            g = cuda_graph(lambda: lay.step())
            rec["graph_ms"] = time_ms(g.replay, it)
            del g
        except Exception as e:  # noqa: BLE001
            rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    # pieces (graph replays where capture works, else eager)
    qf = lay.q_path(lay.x)
    kv_lens = lay.kv_write(lay.x)
    o, lse = lay.attend(qf, kv_lens)
    pieces = {"attn_ms": lambda: lay.attend(qf, kv_lens)}
    if c > 1:
        from dcp_pass.runtime.decode.comm import gather_heads

        if lay.replicated_q:
            pieces["exchange_ms"] = lambda: lay.exchange(o, lse)
        else:
            q_loc = qf.narrow(2, lay.topo.dcp_rank * lay.h_loc, lay.h_loc).contiguous()
            gn = group_name(lay.topo.dcp_group)
            pieces["exchange_ms"] = lambda: (gather_heads(q_loc, gn, c), lay.exchange(o, lse))
    if lay.topo.tp > 1:
        y = torch.randn(B, 1, d["hidden"], device=o.device, dtype=o.dtype)
        fc = torch.ops._c10d_functional
        gn_tp = group_name(lay.topo.tp_group)
        pieces["allreduce_ms"] = lambda: fc.wait_tensor(fc.all_reduce(y, "sum", gn_tp))
    for name, fn in pieces.items():
        try:
            g = cuda_graph(fn)
            rec[name] = time_ms(g.replay, it)
            del g
        except Exception:  # noqa: BLE001
            rec[name] = time_ms(fn, it)
    return rec


# ----------------------------------------------------------------------------- report
def summarize(results, cfg):
    r0 = results[0]
    ceil = r0["ceil"] or {}
    rows = []
    for i, rec0 in enumerate(r0["rows"]):
        recs = [r["rows"][i] for r in results]
        row = dict(rec0)
        row.pop("trace", None)
        for k in ("eager_ms", "graph_ms", "attn_ms", "exchange_ms", "allreduce_ms"):
            vals = [r.get(k) for r in recs if r.get(k) is not None]
            if vals:
                row[k] = max(vals)  # the step is as slow as its slowest rank
        if ceil and "bytes" in row:
            comm = row.get("exchange_ms", 0.0) + row.get("allreduce_ms", 0.0)
            row["floor_ms"] = floor_ms(row["bytes"], row["flops"], ceil) + comm
        rows.append(row)
    # speedups of DCP=c vs DCP=1 at the same (B, L), per mode
    base = {(r["B"], r["L"]): r for r in rows if r["c"] == 1}
    for r in rows:
        b = base.get((r["B"], r["L"]))
        if b is None or r["c"] == 1:
            continue
        for k in ("eager_ms", "graph_ms", "attn_ms"):
            if r.get(k) and b.get(k):
                r["speedup_" + k[:-3]] = b[k] / r[k]
    # capacity: tokens of a 61-layer model's latent cache that fit in what is left of the
    # GPU after this layer's weights x 61 (analytic, from measured memory)
    if r0.get("mem_total"):
        d = SMALL if cfg["small"] else REAL
        per_tok = N_LAYERS * (d["kv_lora"] + d["rope"]) * 2
        for r in rows:
            if "bytes" in r:
                wbytes = N_LAYERS * (r["bytes"] - r["kv_bytes_rank"])
                free = 0.9 * r0["mem_total"] - wbytes
                r["max_tokens"] = int(max(free, 0) / per_tok * r["c"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--tp", type=int, default=None, help="attention TP size (default: world)")
    ap.add_argument("--dcp", default="1,2")
    ap.add_argument("--ctx", default="8192,32768,131072,262144")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--comm", default=",".join(COMM_OF_VARIANT), help="comma list of variants: "
                    + ", ".join(f"{v} ({b})" for v, b in COMM_OF_VARIANT.items()))
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--check", action="store_true", help="compare with a single-process reference")
    ap.add_argument("--small", action="store_true", help="small dims (default with --check)")
    ap.add_argument("--tuned", default=None, help="DCP_MLA_TUNED json for the kernel configs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=540)
    a = ap.parse_args()
    unknown = [v for v in a.comm.split(",") if v not in COMM_OF_VARIANT]
    if unknown:
        ap.error(f"--comm: unknown variant(s) {', '.join(unknown)}; valid: {', '.join(COMM_OF_VARIANT)}")
    from dcp_pass.testing import run_ranks

    if a.check and a.device == "cuda" and not a.small:
        a.small = True
    world = a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    tp = a.tp or world
    cfg = dict(tp=tp, dcp=[int(x) for x in a.dcp.split(",")], ctx=[int(x) for x in a.ctx.split(",")],
               batch=[int(x) for x in a.batch.split(",")], comm=a.comm.split(","), modes=a.modes.split(","),
               iters=a.iters, device=a.device, check=a.check, small=a.small or a.check,
               tuned=os.path.abspath(a.tuned) if a.tuned else None)
    bad = [c for c in cfg["dcp"] if tp % c]
    if bad:
        raise SystemExit(f"DCP sizes {bad} do not divide the attention TP size {tp}")
    t0 = time.time()
    results = run_ranks(worker, world, cfg, backend="nccl" if a.device == "cuda" else "gloo",
                        timeout=a.timeout, env=NO_MULTICAST_ENV)
    rows = summarize(results, cfg)
    out = dict(env=env_info(), cfg=cfg, ceilings=results[0]["ceil"], rows=rows, wall_s=time.time() - t0)
    if a.check:
        cols = [("world", "world"), ("tp", "tp"), ("dcp", "c"), ("comm", "comm"), ("B", "B"), ("L", "L"),
                ("rel err", lambda r: f"{r['rel_err']:.2e}" if "rel_err" in r else r.get("error", "")[:60])]
        worst = max((r.get("rel_err", float("inf")) for r in rows), default=0.0)
        out["worst_rel_err"] = worst
    else:
        cols = [("B", "B"), ("ctx", "L"), ("dcp", "c"), ("comm", "comm"), ("eager ms", "eager_ms"),
                ("graph ms", "graph_ms"), ("attn ms", "attn_ms"), ("exchange ms", lambda r: r.get("exchange_ms", "")),
                ("allreduce ms", lambda r: r.get("allreduce_ms", "")), ("floor ms", lambda r: r.get("floor_ms", "")),
                ("speedup (graph)", lambda r: f"{r['speedup_graph']:.2f}x" if "speedup_graph" in r else ""),
                ("KV MiB/rank", lambda r: f"{r['kv_bytes_rank'] / 2**20:.0f}" if "kv_bytes_rank" in r else ""),
                ("max tokens", lambda r: r.get("max_tokens", "")),
                ("error", lambda r: (r.get("error") or r.get("graph_error") or "")[:50])]
    md = fmt_table(rows, cols)
    out["table_md"] = md
    print(md, flush=True)
    if a.out:
        write_json(a.out, out)
    if a.check:
        tol = 2e-2 if a.device == "cuda" else 1e-4
        if not all(r.get("rel_err", 1.0) < tol for r in rows):
            raise SystemExit(f"layer check failed (tolerance {tol})")


if __name__ == "__main__":
    main()
