"""The narrow fp8 kernel (the product) at several split counts: programs of equal work finish 10-29 us
apart in one wave (probe_fp8_narrow_timeline.py); with two or three waves of smaller splits the block
scheduler hands the later ones to the SMs that are free first. 16 heads, CUDA-graph replay (rotated
input sets), interleaved passes; the output of each count against the default's. Run 2026-12-04, third
stop, nvidia-h200, from scratch/ (results/fp8_narrow_split_counts_h200.json):

    REPS=3 python probe_fp8_narrow_split_counts.py
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import torch
import bench_fp8 as F8
from common import bench, graph_of
from dcp_pass.runtime.decode.kernels import mla_gluon_fp8_narrow as N

CASES = {(8, 32768): (16, 33, 49), (8, 131072): (16, 33, 49), (32, 32768): (4, 8, 12), (32, 131072): (4, 8, 12)}
rows = []
for (B, T), counts in CASES.items():
    sets = F8.make_sets(B, 16, T, True)
    ref = N.run(F8.fp8_call(*sets[0]), num_splits=counts[0])[0].float()
    for rep in range(int(os.environ.get("REPS", "3"))):
        for ns in counts:
            calls = [(lambda s=s, ns=ns: N.run(F8.fp8_call(*s), num_splits=ns)) for s in sets]
            o = calls[0]()[0].float()
            torch.cuda.synchronize()
            rows.append(dict(B=B, T=T, splits=ns, programs=B * ns, rep=rep, ms=bench(graph_of(calls)) / len(calls),
                             rel_vs_default=((o - ref).norm() / ref.norm()).item()))
            print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_narrow_split_counts_h200.json"), "w"), indent=1)
