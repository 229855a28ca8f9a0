"""The narrow fp8 kernel's time a call outside its per-tile stream: full lengths against one key
and no key a request (same cache, same splits), beside the bf16 split kernel and the loader's
stream alone ("ns"), then torch.profiler's per-kernel times of one call at B=8 / 128K (the kernel
and the stage-2 merge). Module `_p3.py` beside time_fp8_narrow_variants.py: the kernel at ec215ce
with absolute imports. Run 2026-12-04 on nvidia-h200 from scratch/
(results/fp8_narrow_fixed_cost_h200.json):

    python probe_fp8_narrow_fixed_cost.py      # -> $OUT/fixed.json
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from time_fp8_narrow_variants import F8, attend, bench, graph_of, module, no_score, source

mods = {"_p3": module("_p3"), "ns_p3": module("ns_p3", no_score(source("_p3")))}
rows = []
for B, T in ((8, 32768), (8, 131072), (32, 32768), (32, 131072)):
    for fp8 in (True, False):
        sets = F8.make_sets(B, 16, T, fp8)
        for lens_kind in ("full", "one", "zero"):
            ss = [(q, kv, (lens if lens_kind == "full" else torch.full_like(lens, 1 if lens_kind == "one" else 0)))
                  for q, kv, lens in sets]
            variants = {"narrow": lambda s: mods["_p3"].run(F8.fp8_call(*s)),
                        "ns_narrow": lambda s: mods["ns_p3"].run(F8.fp8_call(*s))} if fp8 else {
                        "bf16_split": lambda s: attend(F8.bf16_call(*s), "split")}
            for name, fn in variants.items():
                calls = [(lambda s=s, fn=fn: fn(s)) for s in ss]
                calls[0](); torch.cuda.synchronize()
                ms = bench(graph_of(calls)) / len(calls)
                grid = None
                if fp8 and name == "narrow":
                    grid = mods["_p3"].launch_args(F8.fp8_call(*ss[0]).shard())[2][0]
                r = dict(B=B, T=T, variant=name, lens=lens_kind, ms=ms, grid=grid, sets=len(ss))
                rows.append(r); print(json.dumps(r), flush=True)
        del sets
        torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fixed.json"), "w"), indent=1)

# per-kernel device times of one narrow call at B=8 / 128K (the main kernel and the stage-2 merge)
from torch.profiler import ProfilerActivity, profile
sets = F8.make_sets(8, 16, 131072, True)
for lens_kind in ("full", "one"):
    q, kv, lens = sets[0]
    s = (q, kv, lens if lens_kind == "full" else torch.full_like(lens, 1))
    for _ in range(3):
        mods["_p3"].run(F8.fp8_call(*s))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            mods["_p3"].run(F8.fp8_call(*s))
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            r = dict(profile=lens_kind, kernel=e.key[:80], count=e.count,
                     us_each=getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / max(e.count, 1))
            rows.append(r); print(json.dumps(r), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fixed.json"), "w"), indent=1)
