"""The narrow kernel's output stores: `_p3` (the kernel at ec215ce, a thread's 4-byte stores 16
bytes apart), `_p3s` (its columns reordered in registers, 16-byte stores: the change taken at the
next commit) and `_p3n` (no output stores; the compiler then drops the value products too, so its
full-length times are not a store's cost). Outputs of `_p3s` checked bit-equal to `_p3` first
(ragged lengths, 1 / 3 / 16 splits), then all lengths and none. Run 2026-12-04 on nvidia-h200
from scratch/ (results/fp8_narrow_stores_h200.json):

    python probe_fp8_narrow_stores.py     # -> $OUT/store.json
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from time_fp8_narrow_variants import F8, bench, graph_of, module

mods = {n: module(n) for n in ("_p3", "_p3s", "_p3n")}
rows = []
torch.manual_seed(1)
q = torch.randn(12, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
packed = F8.pack(torch.randn(12, 3000, 576, dtype=torch.bfloat16, device="cuda"), F8.LAYOUT)
lens = torch.tensor([0, 1, 2, 63, 64, 65, 127, 129, 1000, 2047, 2999, 3000], device="cuda")
for ns in (1, 3, 16):
    o0, l0 = mods["_p3"].run(F8.fp8_call(q, packed, lens), num_splits=ns)
    o1, l1 = mods["_p3s"].run(F8.fp8_call(q, packed, lens), num_splits=ns)
    r = dict(check="p3s_vs_p3", splits=ns, equal_out=bool(torch.equal(o0, o1)), equal_lse=bool(torch.equal(l0.nan_to_num(0.0), l1.nan_to_num(0.0))))
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
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "store.json"), "w"), indent=1)
