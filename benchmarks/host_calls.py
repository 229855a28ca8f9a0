"""Census of the host calls in the decode graph inductor generates, per DCP variant.

Without CUDA graphs a decode step costs about one host call per kernel launch, extern
call (mm, bmm, the attention op), collective and fallback op in inductor's wrapper code.
This runs `bench_model.py` (a couple of decode steps per variant) under
`TORCH_LOGS=output_code`, takes rank 0's decode graph of every variant from the log (the
second graph Dynamo compiles for the model: the first is the prefill), and counts what its
`call()` does, by kind.

    python benchmarks/host_calls.py --out host_calls.json -- --world 2 --dcp 1,2 --ctx 2048 \
        --batch 8 --positions int --modes default
    python benchmarks/host_calls.py --log existing_output_code.log --out host_calls.json

Arguments after `--` go to bench_model.py (`--steps 2 --warmup 1` are added). The
variant order is bench_model's (DCP sizes in the order given).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, env_info, write_json  # noqa: E402

_LINE = re.compile(r"^\[rank(\d+)\]:.*?\[(\d+)/(\d+)\] \[__output_code\] ?(.*)$")
_CALL = re.compile(r"^(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.[\w.]+|\w+\.run|cpp_fused\w*)\(")


def graphs_of(log_lines, rank=0):
    """[((frame, compile id), wrapper `call()` lines)] of one rank, in log order."""
    graphs = []
    current = None
    for line in log_lines:
        m = _LINE.match(line)
        if not m or int(m.group(1)) != rank:
            continue
        key, text = (int(m.group(2)), int(m.group(3))), m.group(4)
        if "def call(self, args)" in text:
            current = (key, [])
            graphs.append(current)
        elif current is not None and current[0] == key:
            if "Output code written to" in text:
                current = None
            else:
                current[1].append(text)
    return graphs


def census(lines):
    """Host calls of one wrapper's call(), counted by kind (Triton and C++ kernels pooled)."""
    kinds: Counter = Counter()
    for text in lines:
        m = _CALL.match(text.strip())
        if not m:
            continue
        kind = m.group(1)
        if kind.endswith(".run") or kind.startswith("cpp_fused"):
            kind = "generated kernel"
        kinds[kind] += 1
    out = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(kinds.values())
    return out


def decode_graphs(log_lines, rank=0):
    """Each variant's decode graph: the [0/1] compile of frame 0, in the order they appear."""
    return [census(lines) for key, lines in graphs_of(log_lines, rank) if key == (0, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/host_calls.json")
    ap.add_argument("--log", default=None, help="parse this TORCH_LOGS=output_code log instead of running")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--save-log", default=None, help="also write the run's output-code log here")
    ap.add_argument("bench_model_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    extra = [x for x in a.bench_model_args if x != "--"]
    if a.log:
        with open(a.log) as f:
            lines = f.read().splitlines()
    else:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_model.py"), *extra, "--steps", "2",
               "--warmup", "1"]
        env = dict(os.environ, TORCH_LOGS="output_code")
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        lines = (run.stdout + run.stderr).splitlines()
        if a.save_log:
            with open(a.save_log, "w") as f:
                f.write("\n".join(lines) + "\n")
        if run.returncode != 0:
            print("\n".join(lines[-40:]), file=sys.stderr)
            raise SystemExit(run.returncode)
    graphs = decode_graphs(lines, a.rank)
    result = dict(env=env_info(), command=extra, rank=a.rank, decode_graphs=graphs)
    write_json(a.out, result)
    for i, g in enumerate(graphs):
        print(f"variant {i}: {g['total']} host calls per step: " + ", ".join(f"{k} {v}" for k, v in g.items()
                                                                              if k != "total"))


if __name__ == "__main__":
    main()
