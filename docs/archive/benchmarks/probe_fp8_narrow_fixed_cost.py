"""The narrow fp8 kernel's time a call outside its per-tile stream: full lengths against one key
and no key a request (same cache, same splits), CUDA-graph replay, beside the bf16 split kernel
(and, for the builds named in NS, the loader's stream alone: scorers that only free slots), then
torch.profiler's per-kernel device times of one call (the kernel and the stage-2 merge) at each
shape. Module files beside time_fp8_narrow_variants.py, named in the first argument.

    python probe_fp8_narrow_fixed_cost.py MOD[,MOD...]      # -> $OUT/fixed.json
    (env: NS=MOD[,MOD] stream-alone builds, SHAPES=BxT[,BxT] (16 heads), REPS=passes, LENS=full,one,zero)

Runs on nvidia-h200, from scratch/:
- 2026-12-04, first stop (results/fp8_narrow_fixed_cost_h200.json): `_p3.py` = the kernel at ec215ce,
  `NS=_p3 python probe_fp8_narrow_fixed_cost.py _p3` (four shapes, one pass, profile at B=8 / 128K only);
- 2026-12-04, second stop (results/fp8_narrow_fixed_parts_h200.json): `_base` = the kernel at 2f3a314,
  `_q1a` / `_pdl` as in time_fp8_narrow_variants.py,
  `SHAPES=8x32768,8x131072,32x32768 REPS=2 LENS=full,one python probe_fp8_narrow_fixed_cost.py _base,_q1a,_pdl`.
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from torch.profiler import ProfilerActivity, profile
from time_fp8_narrow_variants import F8, attend, bench, graph_of, module, no_score, source

names = sys.argv[1].split(",")
mods = {n: module(n) for n in names}
mods.update({"ns" + n: module("ns" + n, no_score(source(n))) for n in os.environ.get("NS", "").split(",") if n})
shapes = [tuple(int(x) for x in s.split("x")) for s in
          os.environ.get("SHAPES", "8x32768,8x131072,32x32768,32x131072").split(",")]
lens_kinds = os.environ.get("LENS", "full,one,zero").split(",")
out = os.path.join(os.environ.get("OUT", "/tmp"), "fixed.json")
rows = []


def with_lens(s, kind):
    q, kv, lens = s
    return q, kv, (lens if kind == "full" else torch.full_like(lens, 1 if kind == "one" else 0))


for B, T in shapes:
    sets, bsets = F8.make_sets(B, 16, T, True), F8.make_sets(B, 16, T, False)
    for rep in range(int(os.environ.get("REPS", "1"))):
        for kind in lens_kinds:
            for name, mod in list(mods.items()) + [("bf16_split", None)]:
                ss = [with_lens(s, kind) for s in (bsets if mod is None else sets)]
                fn = ((lambda s: attend(F8.bf16_call(*s), "split")) if mod is None
                      else (lambda s, mod=mod: mod.run(F8.fp8_call(*s))))
                calls = [(lambda s=s, fn=fn: fn(s)) for s in ss]
                calls[0](); torch.cuda.synchronize()
                r = dict(B=B, T=T, variant=name, lens=kind, rep=rep, ms=bench(graph_of(calls)) / len(calls),
                         grid=None if mod is None else list(mod.launch_args(F8.fp8_call(*ss[0]).shard())[2][0]))
                rows.append(r); print(json.dumps(r), flush=True)
    for kind in ("full", "one"):
        for name, mod in mods.items():
            s = with_lens(sets[0], kind)
            for _ in range(3):
                mod.run(F8.fp8_call(*s))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    mod.run(F8.fp8_call(*s))
                torch.cuda.synchronize()
            for e in prof.key_averages():
                t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                if t:
                    r = dict(B=B, T=T, profile=kind, variant=name, kernel=e.key[:60], count=e.count,
                             us_each=t / max(e.count, 1))
                    rows.append(r); print(json.dumps(r), flush=True)
    del sets, bsets
    torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)
