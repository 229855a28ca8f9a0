"""Demo: DCP on an unmodified DeepSeek-style model, on CPU ranks with gloo.

    python -m dcp_pass.demo [--c 2] [--context 64] [--comm a2a] [--steps 16] [--report] [--graph]

Spawns c processes, compiles the example model (dcp_pass/models/deepseek_mla.py) with
`torch.compile(model, backend="dcp", options=...)`, decodes a ragged batch greedily, and
prints the layers the pass rewrote (by module path), the KV cache bytes per rank with and
without DCP, and whether the tokens equal the same model's run uncompiled in one process.
`--report` adds the pass's report, `--graph` the code diff of the last rewritten graph.
"""

from __future__ import annotations

import argparse
import sys
import time


def _model_args(context: int, tp: int, dtype_name: str):
    import torch

    from dcp_pass.models.deepseek_mla import ModelArgs

    return ModelArgs(max_seq_len=context, tp_size=tp, dtype=getattr(torch, dtype_name))


def _rank(rank: int, world: int, opts: dict):
    import torch

    from dcp_pass.backend import last_backend, last_report
    from dcp_pass.models.deepseek_mla import build_model
    from dcp_pass.models.generate import greedy_generate

    torch.set_grad_enabled(False)
    model = build_model(_model_args(opts["context"], opts["tp"], opts["dtype"]), rank=rank if opts["tp"] > 1 else 0)
    options = {"dcp_size": world, "tp_size": opts["tp"], "comm_backend": opts["comm"], "inner": opts["inner"]}
    compiled = torch.compile(model, backend="dcp", options=options)  # found by entry point, no import
    assert isinstance(compiled, torch.nn.Module)  # a compiled module stays a module
    start = time.perf_counter()
    tokens, _ = greedy_generate(compiled, opts["prompts"], opts["steps"])
    elapsed = time.perf_counter() - start
    report, backend = last_report(), last_backend()
    if report is None or backend is None:
        raise RuntimeError("the dcp backend compiled no graph of the demo model")
    diffs = backend.diffs
    return {
        "tokens": tokens,
        "report": str(report),
        "seconds": elapsed,
        "diff": diffs[-1] if diffs else "",
        "layers": report.layer_paths(model),
        "kv_full": report.kv_bytes_full,
        "kv_local": report.kv_bytes_local,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--c", type=int, default=2, help="DCP size = number of CPU ranks (default 2)")
    parser.add_argument("--context", type=int, default=64, help="max sequence length of the cache (default 64)")
    parser.add_argument("--comm", default=None, choices=["a2a", "ag_rs"], help="comm backend (default: auto)")
    parser.add_argument("--steps", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--unsharded", action="store_true", help="tp_size=1: every rank holds all heads")
    parser.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--report", action="store_true", help="also print the pass's report (rank 0)")
    parser.add_argument("--graph", action="store_true", help="also print the code diff of the last rewritten graph")
    args = parser.parse_args(argv)

    import torch

    from dcp_pass.models.deepseek_mla import build_model
    from dcp_pass.models.generate import greedy_generate
    from dcp_pass.testing import run_ranks

    prompts = [[11, 5, 42, 7, 3], [9], [2, 71]]
    if max(map(len, prompts)) + args.steps > args.context:
        parser.error(f"--context must be at least {max(map(len, prompts)) + args.steps}")
    tp = 1 if args.unsharded else args.c
    opts = dict(
        context=args.context,
        tp=tp,
        comm=args.comm,
        steps=args.steps,
        inner=args.inner,
        dtype=args.dtype,
        prompts=prompts,
    )
    print(
        f"dcp_pass demo: {args.c} CPU ranks (gloo), DCP={args.c}, TP={tp}, context {args.context}, "
        f"comm {args.comm or 'auto'}, inner {args.inner}, {args.dtype}"
    )
    results = run_ranks(_rank, args.c, opts, timeout=600, threads_per_rank=1)

    torch.set_grad_enabled(False)
    reference = build_model(_model_args(args.context, 1, args.dtype), rank=0)
    ref_tokens, _ = greedy_generate(reference, prompts, args.steps)

    first = results[0]
    print(f"layers rewritten ({len(first['layers'])}): {', '.join(first['layers']) or 'none'}")
    full, local = first["kv_full"], first["kv_local"]
    print(f"KV cache bytes per rank: {full} without DCP -> {local} with DCP ({full / max(local, 1):.2f}x less)")
    same = all(r["tokens"] == ref_tokens for r in results)
    print(
        f"tokens match the uncompiled model: {'YES' if same else 'NO'} "
        f"({len(prompts)} prompts, {args.steps} tokens each, every rank)"
    )
    for prompt, got, want in zip(prompts, first["tokens"], ref_tokens):
        print(f"  prompt {prompt}: dcp {got[:8]}... reference {want[:8]}...")
    print(f"decode time on rank 0: {first['seconds']:.1f}s (compile included)")
    if args.report:
        print(first["report"])
    if args.graph:
        diff = first["diff"].splitlines()
        print(f"code diff of the last rewritten graph on rank 0 ({len(diff)} lines):")
        print("\n".join("  " + line for line in diff))
    if not (args.report or args.graph):
        print("(--report: the pass's report; --graph: the code diff of the last rewritten graph)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
