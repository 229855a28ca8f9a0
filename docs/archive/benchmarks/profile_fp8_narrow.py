"""One narrow fp8 call (16 heads, B=8, 128K keys) for Nsight Compute; the module file as in
time_fp8_narrow_variants.py (`_base.py` beside this script: the kernel at 585a7ec). Run
from `scratch/` beside the variants script, as that was, 2026-12-03 on nvidia-h200
(results/fp8_narrow_profile_h200.txt; shape arguments B T, default 8 131072):

    ncu --clock-control none --kernel-name regex:narrow --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        --import-source no -f -o narrow python profile_fp8_narrow.py _base
    ncu -i narrow.ncu-rep --page details
    ncu -i narrow.ncu-rep --page source --csv --print-source sass   # per-instruction stall samples

and 2026-12-04, second stop, the kernel at 2f3a314 as `_base.py` at B=32 / 128K (results/
fp8_narrow_b32_128k_profile_h200.txt: the WarpStateStats, SourceCounters and SpeedOfLight sections,
`python profile_fp8_narrow.py _base 32 131072`, the source page read by ncu_top_stalls.py).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch  # noqa: E402

import time_fp8_narrow_variants as V  # noqa: E402  (its imports set the paths to benchmarks/ and the package)

mod = V.module(sys.argv[1])
B, T = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (8, 131072)
sets = V.F8.make_sets(B, 16, T, True)
for _ in range(3):  # two launches compile and warm up, the third is profiled
    mod.run(V.F8.fp8_call(*sets[0]))
torch.cuda.synchronize()
