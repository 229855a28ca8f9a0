"""Accuracy of the fp8 latent cache (kv_cache_dtype="fp8_e4m3") on the example models, CPU-runnable.

For the example DeepSeek-style model (dcp_pass/models/deepseek_mla.py) and the hybrid
linear-attention + MLA model (dcp_pass/models/hybrid_linear.py), both with DeepSeek-V3's
512 latent + 64 rotary cache columns: the fp32 model, uncompiled, decodes greedily (the
reference tokens and logits); then each configuration, compiled with backend "dcp" on c
gloo ranks, is fed the same tokens (teacher forcing) for every step:

* ``fp32 model, fp32 cache``: DCP alone (exact up to reduction order: the baseline);
* ``bf16 model, bf16 cache``: the model in bf16, the striped cache in its dtype;
* ``bf16 model, fp8 cache``: the same with kv_cache_dtype="fp8_e4m3";
* ``fp32 model, fp8 cache``: the cache's quantisation alone (rope kept in fp32).

Per configuration: max and mean absolute logit error against the fp32 reference, the
reference logits' standard deviation (their scale), greedy-token agreement (the argmax of
the configuration's logits equals the reference token, over every step and request) and
this rank's KV bytes.

    python benchmarks/fp8_accuracy.py --out benchmarks/results/fp8_accuracy_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONFIGS = (  # (label, model dtype, kv_cache_dtype)
    ("fp32 model, fp32 cache", "float32", None),
    ("bf16 model, bf16 cache", "bfloat16", None),
    ("bf16 model, fp8 cache", "bfloat16", "fp8_e4m3"),
    ("fp32 model, fp8 cache", "float32", "fp8_e4m3"),
)
PROMPTS = [[5, 7, 9, 11, 2, 40, 3, 17], [1, 60], [3, 4, 22, 9], [8, 8, 1, 30, 12, 5]]


def _build(kind: str, dtype: torch.dtype, tp: int, rank: int, steps: int):
    shape = dict(kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype, tp_size=tp,
                 max_seq_len=2 * max(map(len, PROMPTS)) + steps, max_batch_size=len(PROMPTS))
    if kind == "hybrid":
        from dcp_pass.models.hybrid_linear import HybridArgs, build_hybrid

        return build_hybrid(HybridArgs(**shape), rank=rank, seed=3)
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    return build_model(ModelArgs(n_layers=4, n_dense_layers=4, **shape), rank=rank, seed=1)


def _rank(rank: int, world: int, kind: str, steps: int, inner: str):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.generate import greedy_generate, teacher_forced

    torch.set_grad_enabled(False)
    reference = _build(kind, torch.float32, 1, 0, steps)
    spread = max(map(len, PROMPTS)) - min(map(len, PROMPTS))
    tokens, ref_logits = greedy_generate(reference, PROMPTS, steps + spread)  # every request's fed tokens
    ref_logits = torch.stack(ref_logits[:steps + spread])
    rows = []
    for label, dtype, kv_dtype in CONFIGS:
        torch._dynamo.reset()
        model = _build(kind, getattr(torch, dtype), world, rank, steps)
        backend = DcpBackend(dcp_size=world, inner=inner, kv_cache_dtype=kv_dtype)
        logits = torch.stack(teacher_forced(torch.compile(model, backend=backend), PROMPTS, tokens, steps))
        err = (logits - ref_logits).abs()
        rows.append({
            "model": kind, "config": label, "model_dtype": dtype, "kv_cache_dtype": kv_dtype or dtype,
            "steps": steps, "max_abs_err": err.max().item(), "mean_abs_err": err.mean().item(),
            "ref_logit_std": ref_logits.std().item(),
            "greedy_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "kv_bytes_rank": backend.report.kv_bytes_local,
        })
    return rows


def main(argv=None) -> int:
    from dcp_pass.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--c", type=int, default=2, help="DCP size (gloo ranks)")
    p.add_argument("--steps", type=int, default=64, help="decode steps, teacher-forced")
    p.add_argument("--models", default="example,hybrid")
    p.add_argument("--inner", default="aot_eager")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    rows = []
    for kind in args.models.split(","):
        rows += run_ranks(_rank, args.c, kind, args.steps, args.inner, timeout=3600)[0]
    print(f"{'model':8} {'config':24} {'max err':>9} {'mean err':>9} {'ref std':>8} {'agree':>7} {'KV B/rank':>10}")
    for r in rows:
        print(f"{r['model']:8} {r['config']:24} {r['max_abs_err']:9.4f} {r['mean_abs_err']:9.5f} "
              f"{r['ref_logit_std']:8.3f} {r['greedy_agreement']:7.3f} {r['kv_bytes_rank']:10d}")
    if args.out:
        meta = {"c": args.c, "steps": args.steps, "prompts": PROMPTS, "torch": torch.__version__,
                "machine": platform.machine(), "inner": args.inner}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
