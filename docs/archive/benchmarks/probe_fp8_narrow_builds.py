"""Narrow kernel builds against the first one named: outputs on ragged lengths (1 / 3 / 16
splits; bit-equal or the largest differences), then each build's time with all lengths and with
none (a call's fixed part). Module files beside time_fp8_narrow_variants.py. Run 2026-12-04 on
nvidia-h200 from scratch/:

    python probe_fp8_narrow_builds.py _p3 _p3s _p3n   # results/fp8_narrow_stores_h200.json
    python probe_fp8_narrow_builds.py _h _p5          # results/fp8_narrow_merged_partials_h200.json

`_p3`: the kernel at ec215ce (a thread's 4-byte output stores 16 bytes apart); `_p3s`: its columns
reordered in registers, 16-byte stores (taken at 7207fc8); `_p3n`: no output stores (the compiler
then drops the value products too, so its full-length times are not a store's cost). `_h`: the
kernel at 2fde8af, with the split_frame of that commit copied into the module file; `_p5`: it with
fp8_narrow_merged_partials.patch (the two scorers' partials merged in the program; not taken).
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from time_fp8_narrow_variants import F8, bench, graph_of, module

names = sys.argv[1:]
mods = {n: module(n) for n in names}
rows = []
torch.manual_seed(1)
q = torch.randn(12, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
packed = F8.pack(torch.randn(12, 3000, 576, dtype=torch.bfloat16, device="cuda"), F8.LAYOUT)
lens = torch.tensor([0, 1, 2, 63, 64, 65, 127, 129, 1000, 2047, 2999, 3000], device="cuda")
for ns in (1, 3, 16):
    o0, l0 = mods[names[0]].run(F8.fp8_call(q, packed, lens), num_splits=ns)
    for name in names[1:]:
        o1, l1 = mods[name].run(F8.fp8_call(q, packed, lens), num_splits=ns)
        r = dict(check=f"{name}_vs_{names[0]}", splits=ns, equal_out=bool(torch.equal(o0, o1)),
                 max_abs_out=(o0.float() - o1.float()).abs().max().item(),
                 lse_diff=(l0 - l1).nan_to_num(0.0, 0.0, 0.0).abs().max().item(),
                 lse_inf_same=bool(((l0 == float("-inf")) == (l1 == float("-inf"))).all().item()))
        rows.append(r); print(json.dumps(r), flush=True)
for B, T in ((8, 32768), (8, 131072), (32, 32768), (32, 131072)):
    sets = F8.make_sets(B, 16, T, True)
    for rep in range(2):
        for lens_kind in ("full", "zero"):
            ss = [(q, kv, (l if lens_kind == "full" else torch.zeros_like(l))) for q, kv, l in sets]
            for name, mod in mods.items():
                calls = [(lambda s=s, mod=mod: mod.run(F8.fp8_call(*s))) for s in ss]
                calls[0](); torch.cuda.synchronize()
                r = dict(B=B, T=T, variant=name, lens=lens_kind, rep=rep, ms=bench(graph_of(calls)) / len(calls))
                rows.append(r); print(json.dumps(r), flush=True)
    del sets
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "builds.json"), "w"), indent=1)
