"""Does FlashInfer's MLA decode build and run on this machine, and is attn_backend="flashinfer" exact?

Run on the GPU machine through benchmarks/flashinfer_probe.sh (which installs the
vendored wheel and sets the JIT cache). Stages, each recorded in
``$OUT/flashinfer_probe.json`` as soon as it ends (a stage that raises records the
exception and its text, e.g. nvcc's errors, and the next stage still runs):

1. ``env``: python, torch, CUDA, nvcc, GPU, ninja, flashinfer import.
2. ``raw_fa3`` / ``raw_fa2``: FlashInfer's ``BatchMLAPagedAttentionWrapper`` used directly
   (our adapter not involved): B=4, 128 heads, 512+64, bf16, ragged ~4K lengths, page
   sizes 1 and 64, ``return_lse=True``; the JIT build time, the output's relative error
   and the LSE's error against a float64 reference in base 2 and in base e (which base
   it returns), and run times.
3. ``adapter``: ``dcp_pass``'s flashinfer backend (dense decode, striped causal
   verification, paged, fused cache, the custom op) against the float64 reference.
4. ``perf``: decode at 128 and 16 heads, B=8, 4K-128K keys: time, TFLOP/s, fraction of the
   measured bf16 matmul rate, and GB/s; beside it the Triton kernel on the same shape.
5. ``pytest``: tests/test_flashinfer_backend.py on this machine.

Later stages are skipped when the wall-time budget (``--budget`` seconds) runs out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

T0 = time.time()
RESULT: dict = {"stages": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
OUT = os.environ.get("OUT", "/tmp/flashinfer_probe_out")


def _save() -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    os.makedirs(OUT, exist_ok=True)
    tmp = os.path.join(OUT, "flashinfer_probe.json.tmp")
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    os.replace(tmp, os.path.join(OUT, "flashinfer_probe.json"))


def stage(name, fn, *args, **kwargs):
    print(f"=== stage {name} (t={time.time() - T0:.0f}s)", flush=True)
    t = time.time()
    entry = {}
    RESULT["stages"][name] = entry
    try:
        entry.update(fn(*args, **kwargs) or {})
        entry["ok"] = True
    except BaseException as e:  # noqa: BLE001 - record everything, KeyboardInterrupt included
        entry["ok"] = False
        entry["error"] = f"{type(e).__name__}: {e}"[-20000:]
        entry["traceback"] = traceback.format_exc()[-8000:]
        print(entry["traceback"], flush=True)
        if isinstance(e, KeyboardInterrupt):
            raise
    entry["seconds"] = round(time.time() - t, 1)
    _save()
    return entry


def _cmd(args):
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------
def env_stage():
    import torch

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nvcc": _cmd([os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"), "--version"])[-200:],
        "ninja": shutil.which("ninja"),
        "ninja_version": _cmd(["ninja", "--version"]),
        "c++": _cmd(["c++", "--version"]).splitlines()[0:1],
        "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = torch.cuda.get_device_capability(0)
    t = time.time()
    import flashinfer

    info["flashinfer"] = flashinfer.__version__
    info["flashinfer_file"] = flashinfer.__file__
    info["import_s"] = round(time.time() - t, 2)
    if not torch.cuda.is_available():
        raise RuntimeError(f"flashinfer {flashinfer.__version__} imports, but torch sees no CUDA device")
    from flashinfer.utils import determine_mla_backend

    info["flashinfer_auto_mla_backend"] = determine_mla_backend(torch.device("cuda", 0))
    return info


# --------------------------------------------------------------------------------------
def _reference(q_nope, q_pe, ckv, kpe, lens, scale):
    """float64 reference per request over dense [B, T, D] caches: (out [B,H,512], lse_e [B,H])."""
    import torch

    B, H, _ = q_nope.shape
    outs, lses = [], []
    for b in range(B):
        n = int(lens[b])
        k = ckv[b, :n].double()
        s = (torch.einsum("hd,td->ht", q_nope[b].double(), k)
             + torch.einsum("hd,td->ht", q_pe[b].double(), kpe[b, :n].double())) * scale
        m = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - m[:, None]) @ k)
        lses.append(m)
    return torch.stack(outs), torch.stack(lses)


def _time_ms(fn, iters=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def raw_stage(backend):
    """FlashInfer's wrapper used directly: no dcp_pass code in the path."""
    import torch
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, T = 4, 128, 4608
    lens = [4608, 3001, 4097, 17]
    scale = 1.0 / math.sqrt(128 + 64)
    q_nope = (torch.randn(B, H, 512, generator=g, device=dev) * 0.5).bfloat16()
    q_pe = (torch.randn(B, H, 64, generator=g, device=dev) * 0.5).bfloat16()
    ckv = (torch.randn(B, T, 512, generator=g, device=dev) * 0.5).bfloat16()
    kpe = (torch.randn(B, T, 64, generator=g, device=dev) * 0.5).bfloat16()
    ref_o, ref_lse_e = _reference(q_nope, q_pe, ckv, kpe, lens, scale)
    res = {"backend": backend, "B": B, "H": H, "lens": lens, "dtype": "bfloat16", "cases": []}
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend=backend)
    for page_size in (1, 64):
        case = {"page_size": page_size}
        res["cases"].append(case)
        pages_per_row = T // page_size
        # the pool: row b's pages in a shuffled order, as an allocator would leave them
        perm = torch.randperm(B * pages_per_row, generator=g, device=dev)
        ckv_pool = torch.empty(B * pages_per_row, page_size, 512, dtype=torch.bfloat16, device=dev)
        kpe_pool = torch.empty(B * pages_per_row, page_size, 64, dtype=torch.bfloat16, device=dev)
        table = perm.view(B, pages_per_row)
        ckv_pool[table] = ckv.view(B, pages_per_row, page_size, 512)
        kpe_pool[table] = kpe.view(B, pages_per_row, page_size, 64)
        npages = [-(-n // page_size) for n in lens]
        kv_indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0).tolist()), dtype=torch.int32)
        kv_indices = torch.cat([table[b, : npages[b]] for b in range(B)]).int()
        qo_indptr = torch.arange(B + 1, dtype=torch.int32)
        kv_len = torch.tensor(lens, dtype=torch.int32)
        t = time.time()
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, H, 512, 64, page_size, False, scale,
                     torch.bfloat16, torch.bfloat16)
        torch.cuda.synchronize()
        case["first_plan_s"] = round(time.time() - t, 2)  # includes the JIT build on the first case
        out, lse = wrapper.run(q_nope, q_pe, ckv_pool, kpe_pool, return_lse=True)
        torch.cuda.synchronize()
        case["out_shape"], case["lse_shape"] = list(out.shape), list(lse.shape)
        case["out_dtype"], case["lse_dtype"] = str(out.dtype), str(lse.dtype)
        case["rel_err"] = float((out.double() - ref_o).norm() / ref_o.norm())
        case["lse_maxerr_vs_base2"] = float((lse.double() - ref_lse_e / math.log(2)).abs().max())
        case["lse_maxerr_vs_base_e"] = float((lse.double() - ref_lse_e).abs().max())
        case["lse_base"] = "2" if case["lse_maxerr_vs_base2"] < case["lse_maxerr_vs_base_e"] else "e"
        case["run_ms"] = _time_ms(lambda: wrapper.run(q_nope, q_pe, ckv_pool, kpe_pool, return_lse=True))
        case["plan_run_ms"] = _time_ms(lambda: (
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, H, 512, 64, page_size, False, scale,
                         torch.bfloat16, torch.bfloat16),
            wrapper.run(q_nope, q_pe, ckv_pool, kpe_pool, return_lse=True)), iters=10)
        # an empty request: what FlashInfer writes there (the adapter overwrites it with 0 / -inf)
        kv_len0 = torch.tensor([0] + lens[1:], dtype=torch.int32)
        kv_indptr0 = torch.tensor([0, 0] + list((torch.tensor(npages[1:]).cumsum(0)).tolist()), dtype=torch.int32)
        kv_indices0 = torch.cat([table[b, : npages[b]] for b in range(1, B)]).int()
        wrapper.plan(qo_indptr, kv_indptr0, kv_indices0, kv_len0, H, 512, 64, page_size, False, scale,
                     torch.bfloat16, torch.bfloat16)
        out0, lse0 = wrapper.run(q_nope, q_pe, ckv_pool, kpe_pool, return_lse=True)
        torch.cuda.synchronize()
        case["empty_request_lse"] = [float(lse0[0, 0]), float(lse0[0, -1])]
        case["empty_request_out_finite"] = bool(torch.isfinite(out0[0]).all())
        case["empty_request_out_absmax"] = float(out0[0].float().abs().nan_to_num(float("inf")).max())
        case["others_rel_err_with_empty"] = float((out0[1:].double() - ref_o[1:]).norm() / ref_o[1:].norm())
    jit_dir = os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~")), ".cache", "flashinfer")
    sos = []
    for root, _, files in os.walk(jit_dir):
        sos += [(os.path.join(root, f), os.path.getsize(os.path.join(root, f))) for f in files if f.endswith(".so")]
    res["jit_libraries"] = sos
    return res


# --------------------------------------------------------------------------------------
def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _lse_err(a, b):
    import torch

    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("inf")
    return float((a[fa].double() - b[fb].double()).abs().max()) if bool(fa.any()) else 0.0


def adapter_stage():
    import torch

    from dcp_pass.runtime.decode.backends import attend, resolve_attention_backend
    from dcp_pass.runtime.decode.call import AttentionCall
    from dcp_pass.runtime.decode.kernels import flashinfer_mla as fim
    from dcp_pass.runtime.decode.kernels.reference import attention_reference

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.5).bfloat16()

    def ref(q_lat, q_rope, kv, pe, v_dim, scale, **kw):
        d = (lambda t: None if t is None else t.double())  # noqa: E731
        return attention_reference(AttentionCall(d(q_lat), d(q_rope), d(kv), d(pe), v_dim, scale, **kw))

    def run(q_lat, q_rope, kv, pe, v_dim, scale, **kw):
        return attend(AttentionCall(q_lat, q_rope, kv, pe, v_dim, scale, **kw), "flashinfer")

    cases = {}
    res = {"cases": cases, "backend_env": os.environ.get("DCP_FLASHINFER_MLA_BACKEND", "auto")}
    entry = resolve_attention_backend("flashinfer", dev, torch.bfloat16)
    res["table_entry"] = {"name": entry.name, "lse_base": entry.lse_base, "capturable": entry.capturable}
    scale = 1 / math.sqrt(192)

    # dense decode, split cache, ragged device lengths with an empty row, both LSE bases
    B, H, T = 4, 128, 4500
    q_lat, q_rope, kv, pe = rnd(B, 1, H, 512), rnd(B, 1, H, 64), rnd(B, T, 512), rnd(B, T, 64)
    lens = torch.tensor([4500, 0, 3001, 17], device=dev)
    for base in ("2", "e"):
        o, lse = run(q_lat, q_rope, kv, pe, 512, scale, kv_lens=lens, lse_base=base)
        ro, rl = ref(q_lat, q_rope, kv, pe, 512, scale, kv_lens=lens, lse_base=base)
        cases[f"dense_decode_base{base}"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}

    # fused cache (one [.., 576] tensor) and v_dim < 512 on a split cache
    kvf = torch.cat([kv, pe], -1)
    qf = torch.cat([q_lat, q_rope], -1)
    o, lse = run(qf, None, kvf, None, 512, scale, kv_lens=lens, lse_base="2")
    ro, rl = ref(qf, None, kvf, None, 512, scale, kv_lens=lens, lse_base="2")
    cases["fused_cache"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}
    o, lse = run(q_lat, q_rope, kv, pe, 384, scale, kv_lens=lens, lse_base="2")
    ro, rl = ref(q_lat, q_rope, kv, pe, 384, scale, kv_lens=lens, lse_base="2")
    cases["v_dim_384"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}

    # speculative-style verification: S=3 query tokens, striped causality c=4, rank 2
    S, c, r = 3, 4, 2
    q3, r3 = rnd(B, S, H, 512), rnd(B, S, H, 64)
    glob = torch.tensor([17999, 12002, 9, 3], device=dev)
    q_pos = glob.view(-1, 1) - S + torch.arange(S, device=dev).view(1, -1)
    o, lse = run(q3, r3, kv, pe, 512, scale, kv_lens=glob, q_pos=q_pos, stripe=(c, r), lse_base="2")
    ro, rl = ref(q3, r3, kv, pe, 512, scale, kv_lens=glob, q_pos=q_pos, stripe=(c, r), lse_base="2")
    cases["striped_causal_S3_c4"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}

    # paged: page size 64, shuffled pool, the same causal verification
    P = 64
    npg = -(-T // P)
    pool = torch.zeros(B * npg + 5, P, 512, dtype=torch.bfloat16, device=dev)
    pepool = torch.zeros(B * npg + 5, P, 64, dtype=torch.bfloat16, device=dev)
    table = torch.randperm(pool.shape[0], generator=g, device=dev)[: B * npg].view(B, npg)
    padded = torch.zeros(B, npg * P, 512, dtype=torch.bfloat16, device=dev)
    padded[:, :T] = kv
    ppe = torch.zeros(B, npg * P, 64, dtype=torch.bfloat16, device=dev)
    ppe[:, :T] = pe
    pool[table] = padded.view(B, npg, P, 512)
    pepool[table] = ppe.view(B, npg, P, 64)
    o, lse = run(q3, r3, pool, pepool, 512, scale, kv_lens=glob, q_pos=q_pos, stripe=(c, r), lse_base="2",
                 page_table=table)
    cases["paged_P64_causal"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}

    # the custom op the pass emits (int global length and device lengths)
    from dcp_pass.runtime.decode import ops

    op = ops.mla_local_attention
    kv_len_global = 4 * T - 3  # rank 1 of c=4 holds T - 1 keys... the op slices the shard
    o, lse = op(q_lat, q_rope, kv, pe, kv_len_global, 4, 1, 512, scale, None, "2", "flashinfer")
    n_local = kv_len_global // 4 + (1 < kv_len_global % 4)
    ro, rl = ref(q_lat, q_rope, kv[:, :n_local], pe[:, :n_local], 512, scale, lse_base="2")
    cases["custom_op_int_len"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}
    o, lse = op(q_lat, q_rope, kv, pe, 0, 4, 1, 512, scale, None, "2", "flashinfer",
                torch.tensor([kv_len_global], device=dev))
    cases["custom_op_device_len"] = {"rel_err": _rel(o, ro), "lse_maxerr": _lse_err(lse, rl)}
    res["max_rel_err"] = max(v["rel_err"] for v in cases.values())
    res["max_lse_err"] = max(v["lse_maxerr"] for v in cases.values())
    res["plan_key_reused"] = any(r.key is not None for r in fim._RUNNERS.values())
    return res


# --------------------------------------------------------------------------------------
def _matmul_rate():
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192 ** 3 / _time_ms(lambda: a @ a, iters=10) / 1e9


def _perf_row(H, B, T, mm, triton_fn):
    import torch

    from dcp_pass.runtime.decode.kernels import flashinfer_mla as fim

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(2)
    q_lat = (torch.randn(B, 1, H, 512, generator=g, device=dev) * 0.5).bfloat16()
    q_rope = (torch.randn(B, 1, H, 64, generator=g, device=dev) * 0.5).bfloat16()
    kv = (torch.randn(B, T, 512, generator=g, device=dev) * 0.5).bfloat16()
    pe = (torch.randn(B, T, 64, generator=g, device=dev) * 0.5).bfloat16()
    # every row full: the op's int-length path (no device-to-host sync per call)
    flops = 2.0 * B * H * T * (576 + 512)
    bytes_ = B * T * 576 * 2
    row = {"H": H, "B": B, "T": T}
    from dcp_pass.runtime.decode.call import AttentionCall

    call = AttentionCall(q_lat, q_rope, kv, pe, 512, 0.07, lse_base="2")
    fns = {"flashinfer": lambda: fim.run(call)}
    if triton_fn is not None:
        fns["triton"] = lambda: triton_fn(call, "triton")
    results = {}
    for name, fn in fns.items():
        try:
            results[name] = fn()
            t = _time_ms(fn, iters=10)
            row[f"{name}_ms"] = t
            row[f"{name}_tflops"] = flops / t / 1e9
            row[f"{name}_mm_frac"] = flops / t / 1e9 / mm
            row[f"{name}_GBps"] = bytes_ / t / 1e6
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[-2000:]
    if len(results) == 2:
        (o1, l1), (o2, l2) = results["flashinfer"], results["triton"]
        row["rel_diff_vs_triton"] = _rel(o1, o2)
        row["lse_diff_vs_triton"] = float((l1 - l2).abs().max())
    return row


def perf_stage(deadline):
    import torch

    rows = []
    res = {"rows": rows, "mm_rate_tflops": _matmul_rate()}
    torch.cuda.empty_cache()
    try:
        from dcp_pass.runtime.decode.backends import attend as triton_attend
    except Exception as e:  # noqa: BLE001
        triton_attend = None
        res["triton_import_error"] = repr(e)
    for H, B, T in ((128, 8, 4096), (128, 8, 32768), (128, 8, 131072), (16, 8, 32768), (16, 8, 131072)):
        if time.time() > deadline:
            res["stopped_early"] = f"budget reached before H={H} B={B} T={T}"
            break
        row = _perf_row(H, B, T, res["mm_rate_tflops"], triton_attend)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return res


def pytest_stage(timeout):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           os.path.join(REPO, "tests", "test_flashinfer_backend.py")],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-4000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=380.0, help="wall seconds for all stages")
    ap.add_argument("--skip", default="", help="comma list of stages to skip (raw_fa2, perf, pytest, ...)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    end = T0 + args.budget

    def left():
        return end - time.time()

    env = stage("env", env_stage)
    if not env.get("ok"):
        RESULT["verdict"] = "the env stage failed: no flashinfer import or no GPU (see stages.env.error)"
        _save()
        return 1
    raw = stage("raw_fa3", raw_stage, "fa3") if "raw_fa3" not in skip else {}
    if not raw.get("ok") and "adapter" not in skip:
        os.environ["DCP_FLASHINFER_MLA_BACKEND"] = "fa2"  # fa3 failed: see whether fa2 does
    if left() > 120 and "adapter" not in skip:
        stage("adapter", adapter_stage)
    if left() > 150 and "raw_fa2" not in skip and raw.get("ok"):
        stage("raw_fa2", raw_stage, "fa2")
    if left() > 60 and "perf" not in skip:
        stage("perf", perf_stage, end - 45)
    if left() > 40 and "pytest" not in skip:
        stage("pytest", pytest_stage, max(30, left() - 10))
    ok = {k: v.get("ok") for k, v in RESULT["stages"].items()}
    RESULT["stage_ok"] = ok
    RESULT["verdict"] = "ok" if all(ok.values()) else "some stages failed (see their error/traceback)"
    _save()
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
