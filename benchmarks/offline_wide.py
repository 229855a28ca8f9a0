"""Offline sm_90 compile of the two-GEMM wide-head kernels (no GPU needed).

For each config: registers, spill stack, shared memory and the MMA kind (HGMMA = wgmma,
HMMA = mma.sync) of kernel A (scores) and kernel B (values), DeepSeek-V3 shapes (fused
512 + 64 cache, bf16, 128 rows, kv_lens on). The argument list is the launcher's own
(``mla_wide.plan`` on small CPU tensors: same strides, same specialisation as the JIT:
pointers and multiple-of-16 ints get tt.divisibility = 16, ints equal to 1 become
constants). See docs/kernels.md, "Checking a kernel offline".

    python benchmarks/offline_wide.py [--mask] [--causal] [--separate] [--json out.json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dcp_pass.runtime.decode.call import AttentionCall  # noqa: E402
from dcp_pass.runtime.decode.kernels import mla_wide as W  # noqa: E402

_DT = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
       torch.int64: "*i64"}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_launch(launch, src_fn):
    sig, consts, attrs = {}, dict(launch.consts), {}
    names = list(inspect.signature(src_fn).parameters)
    for i, (name, v) in enumerate(zip(names, launch.args)):
        if isinstance(v, torch.Tensor):
            sig[name] = _DT[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif isinstance(v, int):
            if v == 1:
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32" if abs(v) < 2 ** 31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(name)
    params = inspect.signature(src_fn).parameters
    for name in names:
        if name not in sig:
            sig[name] = "constexpr"
            if name not in consts and params[name].default is not inspect.Parameter.empty:
                consts[name] = params[name].default  # a constexpr the launch leaves at its default
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if getattr(launch, "maxnreg", None):
        options["maxnreg"] = launch.maxnreg
    opts = backend.parse_options(options)
    k = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=target, options=opts.__dict__)
    return cubin_report(k)


def cubin_report(k) -> dict:
    """Resources and instruction mix of a compiled kernel, read from its cubin with cuobjdump
    (shipped in Triton's wheel); ``sass_sha1`` tells two builds of the same code apart."""
    import hashlib

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", path], capture_output=True,
                              text=True).stdout
    hg = re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass)
    code = "\n".join(line for line in sass.splitlines() if line.strip().startswith("/*"))
    return dict(regs=int(re.search(r"REG:(\d+)", res).group(1)), stack=int(re.search(r"STACK:(\d+)", res).group(1)),
                smem_kib=round(k.metadata.shared / 1024, 1), hgmma=sorted(set(hg)), n_hgmma=len(hg),
                n_hmma=sass.count(" HMMA"), ldl=sass.count("LDL"), stl=sass.count("STL"),
                cp_async=sass.count("LDGSTS"), tma=sass.count("UTMALDG"), bar=sass.count("BAR.SYNC"),
                l2_prefetch=sass.count("CCTL.E.PF2"), ldsm=sass.count("LDSM."), lds_u8=sass.count("LDS.U8"),
                f2fp_e4m3=sass.count("F2FP.F16.E4M3"), n_qgmma=len(re.findall(r"QGMMA\.\d+x\d+x\d+", sass)),
                sass_sha1=hashlib.sha1(code.encode()).hexdigest()[:12], ttgir=k.asm["ttgir"])


def save_ttgir(directory, name: str, text: str) -> None:
    """Keep a kernel's TTGIR (the layouts Triton chose) as DIR/NAME.ttgir when a directory is given."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{name}.ttgir"), "w") as f:
            f.write(text)


def finish(rows: list, path) -> None:
    """Write the rows as JSON when a path is given."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


CONFIGS = [  # (block_m, block_n, block_k, warps_a, stages_a, block_v, warps_b, stages_b)
    (128, 64, 64, 8, 3, 256, 8, 2),
    (128, 64, 64, 8, 4, 256, 8, 3),
    (128, 128, 64, 8, 3, 256, 8, 2),
    (128, 128, 64, 8, 4, 128, 8, 3),
    (128, 64, 64, 8, 3, 128, 4, 3),
    (128, 64, 64, 8, 3, 128, 8, 4),
    (64, 64, 64, 4, 3, 256, 4, 2),
    (128, 256, 64, 8, 3, 256, 8, 2),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mask", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--separate", action="store_true", help="rope keys in their own tensor")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default=None, help="semicolon-separated 8-tuples")
    ap.add_argument("--ttgir", default=None, help="directory to write the TTGIR of each kernel")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    B, S, H, T = 2, 1, a.heads, 1024
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, a.dtype)
    if a.separate:
        q, qr = torch.randn(B, S, H, 512, generator=g).to(dt), torch.randn(B, S, H, 64, generator=g).to(dt)
        kv, pe = torch.randn(B, T, 512, generator=g).to(dt), torch.randn(B, T, 64, generator=g).to(dt)
    else:
        q, qr, kv, pe = torch.randn(B, S, H, 576, generator=g).to(dt), None, torch.randn(B, T, 576, generator=g).to(dt), None
    lens = torch.full((B,), T, dtype=torch.int64)
    mask = torch.zeros(B, S, H, T) if a.mask else None
    q_pos = torch.full((B, S), T) if a.causal else None
    cfgs = CONFIGS if not a.configs else [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    rows = []
    for c in cfgs:
        cfg = W.WideConfig(*c, num_splits=2)
        out = torch.empty(B, S, H, 512, dtype=dt)
        lse = torch.empty(B, S, H)
        call = AttentionCall(q, qr, kv, pe, 512, 0.07, mask=mask, q_pos=q_pos, kv_lens=lens)
        launches = W.plan(call.shard(), out, lse, cfg)
        rec = dict(config=list(c), tag=cfg.tag())
        for name, launch, src in (("A", launches[0], W._scores_kernel_src), ("B", launches[1], W._values_kernel_src)):
            try:
                r = compile_launch(launch, src)
                save_ttgir(a.ttgir, f"{name}_{'_'.join(map(str, c))}", r.pop("ttgir"))
            except Exception as e:  # noqa: BLE001
                r = dict(error=repr(e)[:400])
            rec[name] = r
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    finish(rows, a.json)


if __name__ == "__main__":
    main()
