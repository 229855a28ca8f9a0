"""KV capacity of a GPU pair with and without DCP, under a per-rank memory cap.

Every probe is a fresh 2-rank process group (an OOM cannot leave a peer stuck in a
collective): each rank caps its GPU with torch.cuda.set_per_process_memory_fraction,
builds the example model (dcp_pass/models/deepseek_mla.py, TP over both ranks, caches of
`ctx` positions), compiles it with DcpBackend(dcp_size=c) and decodes `--steps` tokens.
DCP=1 is built the ordinary way (full cache buffers); DCP>1 is built under
dcp_pass.deferred_caches() and dcp_pass.materialize() gives each rank its stripe, so no
rank ever allocates a full cache. torch.cuda.max_memory_allocated is recorded from
construction through the last decode step.

    # 1. largest context per GPU pair for each DCP size (bisection after a linear fit)
    python benchmarks/bench_capacity.py --what search --dcp 1 --out benchmarks/results/capacity_h200x2.json
    python benchmarks/bench_capacity.py --what search --dcp 2 --out benchmarks/results/capacity_h200x2.json
    # 2. one context between the two: DCP=1 must fail with OOM at construction, DCP=2 decode
    python benchmarks/bench_capacity.py --what headline --out benchmarks/results/capacity_h200x2.json
    # CPU rehearsal (gloo, tiny model, the cap emulated from the bytes a rank holds)
    python benchmarks/bench_capacity.py --dry-cpu --out /tmp/capacity_dry.json
    # the fp8 stripe (kv_cache_dtype="fp8_e4m3"), DCP=1 on each GPU (through fast_path)
    python benchmarks/bench_capacity.py --what search --dcp 1 --kv-cache-dtype fp8_e4m3 --out capacity_fp8.json

Results merge into --out (one call per step fits the device tool's 10-minute limit):
`probes` (every run: ok / oom and the phase it failed in, peak bytes), `max_ctx`,
`peak_bytes_at_dcp1_max` (both DCP sizes at DCP=1's largest context), `headline`
(`dcp1_oom_at_construction`, `dcp2_fits`, both peaks) and `does_not_fit`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import NO_MULTICAST_ENV, ROOT, env_info, write_json  # noqa: E402

MODELS = {  # dense layers only: one decode graph, no data-dependent MoE loop
    "mid": dict(dim=2048, inter_dim=4096, n_layers=4, n_dense_layers=4, n_heads=16, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=32000),
    "tiny": dict(dim=64, inter_dim=128, n_layers=2, n_dense_layers=2, n_heads=8, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128),
}


def _held_bytes(model) -> int:
    """Bytes of every storage the model holds, plus the DCP shards of its caches."""
    from dcp_pass.state import memory, store

    tensors = [*model.parameters(), *model.buffers()]
    tensors += [e.local for e in map(store.lookup_local_cache, model.buffers()) if e is not None]
    return sum({t.untyped_storage()._cdata: memory.held_nbytes(t) for t in tensors}.values())


def _cache_bytes(model) -> int:
    from dcp_pass.state import memory, store

    total = 0
    for name, buf in model.named_buffers():
        if name.endswith("_cache"):
            entry = store.lookup_local_cache(buf)
            total += entry.local_nbytes if entry is not None else memory.held_nbytes(buf)
    return total


def _peak(dev, model=None) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return _held_bytes(model) if model is not None else 0  # CPU: what the rank holds (no allocator stats)


def probe(rank, world, cfg):
    """One (dcp size, context) run on every rank; returns this rank's record."""
    sys.path.insert(0, ROOT)
    import torch.distributed as dist

    import dcp_pass
    from bench_model import random_model
    from dcp_pass.backend import DcpBackend
    from dcp_pass.topology import topology_from_world
    from dcp_pass.models.deepseek_mla import ModelArgs

    torch.set_grad_enabled(False)
    c, ctx, cuda = cfg["c"], cfg["ctx"], cfg["device"] == "cuda"
    dev = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    status = dist.new_group(backend="gloo")  # agreeing on an OOM must not need GPU memory
    if cuda:
        torch.cuda.set_device(dev)
        torch.cuda.set_per_process_memory_fraction(cfg["cap_bytes"] / torch.cuda.get_device_properties(dev).total_memory, dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    dtype = torch.bfloat16 if cuda else torch.float32
    args = ModelArgs(dtype=dtype, tp_size=world, max_batch_size=cfg["batch"], max_seq_len=ctx, positions="tensor",
                     **MODELS[cfg["model"]])
    rec = dict(c=c, ctx=ctx, batch=cfg["batch"], cap_bytes=cfg["cap_bytes"], rank=rank)

    model, error = None, None
    fp8 = cfg.get("kv_cache_dtype") is not None
    try:  # construction: weights and this rank's caches (full for DCP=1, its stripe for DCP>1)
        if cuda and cfg.get("check_allocs"):
            torch.cuda.memory._record_memory_history(max_entries=100000)
        # an fp8 cache is never allocated in the model's dtype: deferred, its first compile gives it
        # the fp8 stripe (DCP=1 too, through fast_path)
        deferred = c > 1 or fp8
        with dcp_pass.deferred_caches(min_bytes=cfg["defer_min_bytes"]) if deferred else contextlib.nullcontext():
            model = random_model(args, rank, dev, seed=1)
        if c > 1 and not fp8:
            dcp_pass.materialize(model, dcp_size=c, rank=topology_from_world(c, world, 1).dcp_rank)
        if not cuda and _held_bytes(model) > cfg["cap_bytes"]:
            raise torch.OutOfMemoryError(f"CPU dry run: {_held_bytes(model)} bytes held > emulated cap {cfg['cap_bytes']}")
    except torch.OutOfMemoryError as e:
        model, error = None, f"{type(e).__name__}: {e}"[:300]
    ok = torch.tensor([0 if error else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=status)
    if not ok.item():
        return dict(rec, ok=False, oom=True, phase="construction", error=error or "OOM on the other rank",
                    peak_bytes=_peak(dev))
    rec.update(peak_construction_bytes=_peak(dev, model), held_after_construction=_held_bytes(model),
               kv_bytes_rank=_cache_bytes(model))

    phase = "compile + first step"
    try:  # past here collectives run: an OOM raises, and run_ranks ends the peer
        backend = DcpBackend(dcp_size=c, tp_size=world, inner=cfg["inner"], cudagraphs=False,  # no graph pools
                             kv_cache_dtype=cfg.get("kv_cache_dtype"), fast_path=fp8 and c == 1)
        compiled = torch.compile(model, backend=backend)
        tok = torch.randint(0, args.vocab_size, (cfg["batch"], 1), generator=torch.Generator().manual_seed(5)).to(dev)
        t0 = time.time()
        tok = compiled(tok, torch.tensor(0, device=dev)).argmax(-1, keepdim=True)
        rec["first_call_s"] = time.time() - t0
        rec["kv_bytes_rank"] = _cache_bytes(model)  # a deferred cache's stripe exists from the first call
        if not cuda and _held_bytes(model) > cfg["cap_bytes"]:
            raise torch.OutOfMemoryError(f"CPU dry run: {_held_bytes(model)} bytes held > emulated cap {cfg['cap_bytes']}")
        if cuda and cfg.get("check_allocs"):  # every allocation from construction through the first step
            big = max(_full_cache_sizes(model))
            trace = torch.cuda.memory._snapshot()["device_traces"][dev.index]
            rec["allocs_of_full_cache_size"] = sum(1 for ev in trace if ev["action"] == "alloc" and ev["size"] >= big)
            torch.cuda.memory._record_memory_history(enabled=None)
        phase, times = "decode", []
        for pos in range(1, cfg["steps"] + 1):
            ts = time.perf_counter()
            tok = compiled(tok, torch.tensor(pos, device=dev)).argmax(-1, keepdim=True)
            tok.tolist()  # host sync: the step is over
            times.append((time.perf_counter() - ts) * 1e3)
    except Exception as e:  # Dynamo wraps an OOM raised while it compiles
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            raise RuntimeError(f"OOM_PHASE={phase}: {e}"[:2000]) from e
        raise
    return dict(rec, ok=True, oom=False, steps=cfg["steps"], step_ms_median=statistics.median(times),
                peak_bytes=_peak(dev, model), rewritten=backend.report.layers_rewritten)


def _full_cache_sizes(model):
    return [b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("_cache")]


def run_probe(cfg, c, ctx):
    """Run one probe; a rank's OOM after construction comes back as a failed record."""
    from dcp_pass.testing import run_ranks

    cfg = dict(cfg, c=c, ctx=ctx)
    t0 = time.time()
    try:
        ranks = run_ranks(probe, cfg["world"], cfg, backend="nccl" if cfg["device"] == "cuda" else "gloo",
                          timeout=cfg["timeout"], env=NO_MULTICAST_ENV)
        rec = dict(ranks[0], peak_bytes=max(r["peak_bytes"] for r in ranks), ok=all(r["ok"] for r in ranks))
    except RuntimeError as e:
        text = str(e)
        oom = "OOM_PHASE=" in text or "OutOfMemoryError" in text
        # The first "OOM_PHASE=" of a traceback can be the source line of the raise itself
        phases = re.findall(r"OOM_PHASE=([^{:]+):", text)
        phase = phases[0] if phases else None
        rec = dict(c=c, ctx=ctx, ok=False, oom=oom, phase=phase, error=text[-600:])
    rec["wall_s"] = round(time.time() - t0, 1)
    print("probe", {k: v for k, v in rec.items() if k != "error"}, flush=True)
    return rec


def search(cfg, c, probes):
    """Largest context that constructs and decodes for DCP size c.

    Two small probes fit peak(ctx) = a + b * ctx; the prediction for the cap is then
    bracketed and bisected. Returns (max ctx that fit, every probe record).
    """
    small = cfg["search_start"]
    recs = [run_probe(cfg, c, small), run_probe(cfg, c, 2 * small)]
    if not all(r["ok"] for r in recs):
        return None, recs
    b = (recs[1]["peak_bytes"] - recs[0]["peak_bytes"]) / small  # bytes per position
    predicted = int((cfg["cap_bytes"] - (recs[0]["peak_bytes"] - b * small)) / b) if b > 0 else 4 * small
    lo, hi = 2 * small, None
    for ctx in (int(predicted * 0.97), int(predicted * 1.03)):
        rec = run_probe(cfg, c, ctx)
        recs.append(rec)
        if rec["ok"]:
            lo = max(lo, ctx)
        else:
            hi = ctx if hi is None else min(hi, ctx)
    while hi is None and len(recs) < probes + 2:  # the fit was pessimistic: grow
        ctx = 2 * lo
        rec = run_probe(cfg, c, ctx)
        recs.append(rec)
        lo, hi = (ctx, None) if rec["ok"] else (lo, ctx)
    while hi is not None and len(recs) < probes + 2 and hi - lo > cfg["resolution"] * lo:
        ctx = (lo + hi) // 2
        rec = run_probe(cfg, c, ctx)
        recs.append(rec)
        lo, hi = (ctx, hi) if rec["ok"] else (lo, ctx)
    return lo, recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="all", choices=["search", "headline", "all"])
    ap.add_argument("--dcp", default="1,2", help="DCP sizes to search (comma list)")
    ap.add_argument("--cap-gib", type=float, default=16.0, help="memory cap per rank (set_per_process_memory_fraction)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100, help="decode steps after the first call")
    ap.add_argument("--model", default="mid", choices=sorted(MODELS))
    ap.add_argument("--inner", default="eager", help="inner compiler; eager compiles fast, capacity is about memory")
    ap.add_argument("--probes", type=int, default=6, help="probes per DCP size after the two small ones")
    ap.add_argument("--resolution", type=float, default=0.02, help="stop bisecting at this relative bracket")
    ap.add_argument("--search-start", type=int, default=16384, help="context of the first small probe")
    ap.add_argument("--ctx", type=int, default=None, help="headline context (default: from the search results)")
    ap.add_argument("--check-allocs", action="store_true", help="record CUDA allocations: count full-cache-size ones")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default=None, choices=["fp8_e4m3"],
                    help="the striped cache's storage (option kv_cache_dtype); DCP=1 runs it through fast_path")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--dry-cpu", action="store_true", help="CPU rehearsal: gloo, tiny model, emulated cap")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "capacity_h200x2.json"))
    a = ap.parse_args()

    cfg = dict(world=a.world, batch=a.batch, steps=a.steps, model=a.model, inner=a.inner, timeout=a.timeout,
               cap_bytes=int(a.cap_gib * 2 ** 30), resolution=a.resolution, search_start=a.search_start,
               check_allocs=a.check_allocs, device="cuda", defer_min_bytes=1 << 20, kv_cache_dtype=a.kv_cache_dtype)
    if a.dry_cpu:  # ~300 KB of weights per rank, 640 B of cache per position at DCP=1: the cap binds near 450
        cfg.update(device="cpu", model="tiny", batch=2, steps=min(a.steps, 5), cap_bytes=600 * 1024, search_start=64,
                   defer_min_bytes=0)  # its caches are smaller than deferred_caches' default threshold
        a.probes = min(a.probes, 3)
    out = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            out = json.load(f)
    out.setdefault("probes", [])
    out.update(env=env_info(), config={k: v for k, v in cfg.items() if k != "world"} | {"model_dims": MODELS[cfg["model"]]})

    if a.what in ("search", "all"):
        for c in (int(x) for x in a.dcp.split(",")):
            best, recs = search(cfg, c, a.probes)
            out["probes"] += recs
            out.setdefault("max_ctx", {})[str(c)] = best
            out.setdefault("does_not_fit", {})[str(c)] = min((r["ctx"] for r in recs if not r["ok"]), default=None)
            write_json(a.out, out)
        found = out.get("max_ctx", {})
        if found.get("1") and found.get("2"):  # both sizes at DCP=1's largest context
            at = [r for r in out["probes"] if r["ctx"] == found["1"] and r["ok"]]
            if not any(r["c"] == 2 for r in at):
                at.append(run_probe(cfg, 2, found["1"]))
                out["probes"].append(at[-1])
            out["peak_bytes_at_dcp1_max"] = {str(r["c"]): r["peak_bytes"] for r in at}
            write_json(a.out, out)

    if a.what in ("headline", "all"):
        found = out.get("max_ctx", {})
        ctx = a.ctx or (int((found["1"] * found["2"]) ** 0.5) if found.get("1") and found.get("2") else None)
        if ctx is None:
            raise SystemExit("headline: pass --ctx, or run --what search for DCP 1 and 2 first")
        one, two = run_probe(cfg, 1, ctx), run_probe(cfg, 2, ctx)
        out["probes"] += [one, two]
        out["headline"] = dict(
            ctx=ctx, cap_bytes=cfg["cap_bytes"],
            dcp1_oom_at_construction=bool(one.get("oom") and one.get("phase") == "construction"),
            dcp2_fits=bool(two["ok"]), dcp2_steps=two.get("steps"),
            peak_bytes_dcp1=one.get("peak_bytes"), peak_bytes_dcp2=two.get("peak_bytes"),
            kv_bytes_rank_dcp2=two.get("kv_bytes_rank"), allocs_of_full_cache_size_dcp2=two.get("allocs_of_full_cache_size"))
        write_json(a.out, out)
        print("headline", out["headline"], flush=True)
    print("max_ctx", out.get("max_ctx"), "does_not_fit", out.get("does_not_fit"), flush=True)


if __name__ == "__main__":
    main()
