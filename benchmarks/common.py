"""Shared helpers for the GPU benchmarks: ceilings, timing, result files."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# DeepSeek-V3 MLA shapes
KV_LORA = 512
ROPE = 64
QK_NOPE = 128
V_HEAD = 128
SCALE = 192 ** -0.5
HIDDEN = 7168
Q_LORA = 1536
N_HEADS = 128
N_LAYERS = 61

# environment of the multi-GPU benchmark ranks: no NVLink multicast (NVLS) anywhere
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def bench(fn, warmup_ms=25, rep_ms=100):
    """Median time in ms through triton.testing.do_bench (CUDA events, L2 flushed per call)."""
    if not torch.cuda.is_available():  # CPU dry run of a script: a plain median of a few calls
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[1]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth(nbytes=2 << 30, device="cuda"):
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    if device != "cuda":
        nbytes = 1 << 24
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * nbytes / (t * 1e-3)


def matmul_rate(n=8192, device="cuda"):
    """bf16 matmul rate in FLOP/s on random data."""
    if device != "cuda":
        n = 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t = bench(lambda: a @ b)
    return 2 * n ** 3 / (t * 1e-3)


def graph_of(calls):
    """Capture the calls (one per rotated input set) in one CUDA graph; returns replay fn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g.replay


def floor_ms(nbytes, flops, ceil):
    """Roofline floor in ms: max(bytes / copy bandwidth, flops / matmul rate) of ``ceil``."""
    return max(nbytes / ceil["copy_bw"], flops / ceil["mm_rate"]) * 1e3


def without_replay(fn):
    """`fn()` with the attention op's replay off (DCP_REPLAY=0): its Python path every call."""
    os.environ["DCP_REPLAY"] = "0"
    try:
        return fn()
    finally:
        os.environ.pop("DCP_REPLAY")


def env_info():
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2 ** 30, 1),
                    n_gpus=torch.cuda.device_count())
    return info


def write_json(path, obj):
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def fmt_table(rows, cols):
    """Markdown table from a list of dicts."""
    out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for _, key in cols:
            v = key(r) if callable(key) else r.get(key, "")
            cells.append(v if isinstance(v, str) else (f"{v:.3g}" if isinstance(v, float) else str(v)))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def probe_parser(out, shapes, passes):
    """The options every side-by-side probe takes (then handed to :func:`probe_shapes`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=out)
    ap.add_argument("--shapes", default=shapes, help="HxBxT,...")
    ap.add_argument("--passes", type=int, default=passes, help="alternating passes over the variants")
    return ap


def probe_shapes(out, shapes, one_shape, columns):
    """Driver of the side-by-side probes (CUDA only): the ceilings first, then
    ``one_shape(H, B, T, ceil)`` -> that shape's rows for every "HxBxT" of ``shapes``, the
    JSON (env, ceilings, rows, table_md) rewritten after each shape, the table printed last."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    results = dict(env=env_info())
    ceil = dict(copy_bw=copy_bandwidth(), mm_rate=matmul_rate())
    results["ceilings"] = ceil
    rows = []
    for sh in shapes.split(","):
        H, B, T = (int(x) for x in sh.split("x"))
        for rec in one_shape(H, B, T, ceil):
            rows.append(rec)
            print("row", rec, flush=True)
        results["rows"] = rows
        write_json(out, results)
        torch.cuda.empty_cache()
    results["table_md"] = fmt_table(rows, columns)
    write_json(out, results)
    print(results["table_md"], flush=True)
    return results
