"""fp8 role-split kernel builds beside the product's (`gluon_fp8`) at 128 and 64 heads, after a
check of each build's output against the product's on ragged lengths (0 to 3000 keys).

Module files beside this script, from kernels/mla_gluon_fp8.py at b42cb7d with absolute
imports (as in time_fp8_narrow_variants.py's docstring) and one keyword added to the loader's
16-byte loads of the fp8 words (`_load_block`: `gl.load(..., mask=keep[:, None], other=0)`):
`_f8cg.py` cache_modifier=".cg" (LDG.E.128.STRONG.GPU: not cached in L1), `_f8ef.py`
eviction_policy="evict_first" (LDG.E.EF.128). Run from a folder one level below the
repository root holding this script, time_fp8_narrow_variants.py and the module files (the
run used scratch/), 2026-12-03 on nvidia-h200 (results/fp8_roles_load_hints_h200.json):

    python time_fp8_roles_builds.py _f8cg,_f8ef

and at the second stop of 2026-12-04 (results/fp8_roles_converter_h200.json), with the shapes
below (128 heads, B=8 32K / 128K, B=32 32K), REPS passes and the bf16 cache's role-split kernel
beside them: `_r3.py` = mla_gluon_fp8.py at 2f3a314 with fp8_roles_converter_warpgroup.patch
(its registers from R3_REGS, "value-GEMM warpgroup,converter"):

    R3_REGS=160,120 REPS=3 python time_fp8_roles_builds.py _r3
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks")); sys.path.insert(0, os.path.join(HERE, "..")); sys.path.insert(0, HERE)
import torch
import bench_fp8 as F8
from common import bench, graph_of
from dcp_pass.runtime.decode.backends import attend
from time_fp8_narrow_variants import module
mods = {n: module(n) for n in sys.argv[1].split(",")}
rows = []
def rec(**r):
    rows.append(r); print(json.dumps(r), flush=True)
torch.manual_seed(1)
q = torch.randn(6, 1, 128, 576, dtype=torch.bfloat16, device="cuda")
packed = F8.pack(torch.randn(6, 3000, 576, dtype=torch.bfloat16, device="cuda"), F8.LAYOUT)
lens = torch.tensor([0, 1, 65, 1000, 2999, 3000], device="cuda")
o0, l0 = attend(F8.fp8_call(q, packed, lens), "gluon_fp8")
for n, m in mods.items():
    o, l = m.run(F8.fp8_call(q, packed, lens))
    rec(check="ragged", variant=n, max_abs=(o.float() - o0.float()).abs().max().item(), lse=(l - l0).nan_to_num(0., 0., 0.).abs().max().item())
for H, B, T in ((128, 8, 32768), (128, 8, 131072), (128, 32, 32768)):
    sets = F8.make_sets(B, H, T, True)
    bsets = F8.make_sets(B, H, T, False)
    for rep in range(int(os.environ.get("REPS", "2"))):
        calls = [(lambda s=s: attend(F8.fp8_call(*s), "gluon_fp8")) for s in sets]
        calls[0](); torch.cuda.synchronize()
        rec(H=H, B=B, T=T, variant="product", rep=rep, ms=bench(graph_of(calls)) / len(calls))
        for n, m in mods.items():
            calls = [(lambda s=s, m=m: m.run(F8.fp8_call(*s))) for s in sets]
            calls[0](); torch.cuda.synchronize()
            rec(H=H, B=B, T=T, variant=n, rep=rep, ms=bench(graph_of(calls)) / len(calls))
        calls = [(lambda s=s: attend(F8.bf16_call(*s), "gluon_roles")) for s in bsets]
        calls[0](); torch.cuda.synchronize()
        rec(H=H, B=B, T=T, variant="bf16_gluon_roles", rep=rep, ms=bench(graph_of(calls)) / len(calls))
    del sets, bsets
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_roles_builds.json"), "w"), indent=1)
