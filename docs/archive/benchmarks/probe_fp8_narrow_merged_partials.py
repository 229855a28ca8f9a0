"""The narrow kernel with its two scorers' partials merged in the program (`_p5.py`: the kernel at
2fde8af with fp8_narrow_merged_partials.patch, which also drops split_frame's partials_per_split)
against that kernel as it is (`_h.py`: one partial a scorer, merged by the stage-2 kernel; its
launch builds the partials with the split_frame of 2fde8af, copied into the module file):
outputs on ragged lengths, then all lengths and none. Run 2026-12-04 on nvidia-h200 from scratch/
after the narrow GPU tests passed on the patched tree (results/fp8_narrow_merged_partials_h200.json):

    python probe_fp8_narrow_merged_partials.py     # -> $OUT/merge.json
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from time_fp8_narrow_variants import F8, bench, graph_of, module

mods = {n: module(n) for n in ("_h", "_p5")}
rows = []
torch.manual_seed(1)
q = torch.randn(12, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
packed = F8.pack(torch.randn(12, 3000, 576, dtype=torch.bfloat16, device="cuda"), F8.LAYOUT)
lens = torch.tensor([0, 1, 2, 63, 64, 65, 127, 129, 1000, 2047, 2999, 3000], device="cuda")
for ns in (1, 3, 16):
    o0, l0 = mods["_h"].run(F8.fp8_call(q, packed, lens), num_splits=ns)
    o1, l1 = mods["_p5"].run(F8.fp8_call(q, packed, lens), num_splits=ns)
    r = dict(check="p5_vs_h", splits=ns, max_abs_out=(o0.float() - o1.float()).abs().max().item(),
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
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "merge.json"), "w"), indent=1)
