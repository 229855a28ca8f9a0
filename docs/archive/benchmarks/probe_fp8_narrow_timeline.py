"""Per-program timeline of the narrow fp8 kernel: %globaltimer at a program's entry, after its query
prologue and at its end, and its SM, for full-length calls (L2 flushed before each launch, 16
heads, six launches of which the first two warm up). What the part of a streaming call outside
its per-tile stream is made of: the launch ramp (the spread of entries), the prologue, and how
unevenly the programs finish.

The module `_ts.py` beside this script is kernels/mla_gluon_fp8_narrow.py at 8af8e57 with
fp8_narrow_timeline_stamps.patch applied and its imports made absolute, as
time_fp8_narrow_variants.py says; its `launch_args` passes `TS_BUF[0]` ([programs, 4] int64).
Run 2026-12-04, third stop, nvidia-h200, from scratch/ (results/fp8_narrow_timeline_h200.json):

    python probe_fp8_narrow_timeline.py        # -> $OUT/fp8_narrow_timeline_h200.json
"""
import importlib.util, json, os, statistics, sys
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import torch
import bench_fp8 as F8

spec = importlib.util.spec_from_file_location("_ts", os.path.join(HERE, "_ts.py"))
M = importlib.util.module_from_spec(spec); spec.loader.exec_module(M)
out_dir = os.environ.get("OUT", ".")
rows = []
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
for B, T in ((8, 2048), (8, 32768), (8, 131072), (32, 32768), (32, 131072)):
    q, packed, lens = F8.make_sets(B, 16, T, True)[0]
    call = F8.fp8_call(q, packed, lens)
    for rep in range(6):
        M.TS_BUF.clear()
        _, _, (grid, args, consts, stage2) = M.launch_args(call.shard())
        n = grid[0] * grid[1] * grid[2]
        ts = torch.zeros(n, 4, dtype=torch.int64, device="cuda")
        M.TS_BUF.append(ts)
        _, _, (grid, args, consts, stage2) = M.launch_args(call.shard())
        flush.zero_()
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        M._narrow_jit[grid](*args, **consts, num_warps=4)
        ev1.record()
        torch.cuda.synchronize()
        if rep < 2:
            continue  # compile and warm
        t = ts.cpu()
        t0 = t[:, 0].min().item()
        begin = (t[:, 0] - t0) / 1e3
        ready = (t[:, 1] - t0) / 1e3
        end = (t[:, 2] - t0) / 1e3
        dur = end - begin
        r = dict(B=B, T=T, grid=list(grid), programs=n, event_us=ev0.elapsed_time(ev1) * 1e3,
                 span_us=end.max().item(), begin_max_us=begin.max().item(),
                 prologue_median_us=(ready - begin).median().item(), prologue_max_us=(ready - begin).max().item(),
                 end_min_us=end.min().item(), end_median_us=end.median().item(), end_max_us=end.max().item(),
                 dur_min_us=dur.min().item(), dur_median_us=dur.median().item(), dur_max_us=dur.max().item(),
                 sms=len(set(t[:, 3].tolist())),
                 end_deciles_us=[round(x, 2) for x in torch.quantile(end, torch.linspace(0, 1, 11)).tolist()])
        rows.append(r)
        print(json.dumps(r), flush=True)
json.dump(dict(rows=rows, torch=torch.__version__), open(os.path.join(out_dir, "fp8_narrow_timeline_h200.json"), "w"),
          indent=1)
