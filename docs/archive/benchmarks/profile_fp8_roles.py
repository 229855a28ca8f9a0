"""One 128-head call (B=8, 32K keys) of the fp8 role-split kernel (`gluon_fp8`) or of the bf16
one (`gluon_roles`) for Nsight Compute. Run from a folder one level below the repository root
(the run used scratch/), 2026-12-03 on nvidia-h200 (results/fp8_roles_profile_h200.txt):

    ncu --clock-control none --kernel-name _fp8_kernel_src --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section SourceCounters --section LaunchStats --section Occupancy \\
        --section ComputeWorkloadAnalysis --import-source no -f -o r128_fp8 \\
        python profile_fp8_roles.py fp8
    (the same with --kernel-name _roles_kernel_src ... python profile_fp8_roles.py bf16)
    ncu -i r128_fp8.ncu-rep --page details
    ncu -i r128_fp8.ncu-rep --page source --csv --print-source sass   # per-instruction stall samples
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
import torch  # noqa: E402

import bench_fp8 as F8  # noqa: E402
from dcp_pass.runtime.decode.backends import attend  # noqa: E402

fp8 = sys.argv[1] == "fp8"
sets = F8.make_sets(8, 128, 32768, fp8)
for _ in range(3):  # two launches compile and warm up, the third is profiled
    if fp8:
        attend(F8.fp8_call(*sets[0]), "gluon_fp8")
    else:
        attend(F8.bf16_call(*sets[0]), "gluon_roles")
torch.cuda.synchronize()
