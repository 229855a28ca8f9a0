"""Whole-model decode with the compile pass: examples/deepseek_mla.py, torch.compile(backend="dcp").

Every rank builds the unmodified example model (TP over all ranks, dense layers only so
the graph count stays small), compiles it with DcpBackend(dcp_size=c), prefills one
prompt and times greedy decode steps. DCP=1 and DCP=c run back to back; rank 0's
tokens are compared between them.

    python benchmarks/bench_model.py --world 2 --dcp 1,2 --prompt 2048 --steps 16 --out model.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROOT, env_info, fmt_table, write_json  # noqa: E402


def _profile_steps(m, nxt, pos, dev, steps=3, tensor_positions=False):
    """Top host and device ops of a few decode steps (where the step time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            logits = m(nxt, torch.tensor(pos + i, device=dev) if tensor_positions else pos + i)
            nxt = logits.argmax(-1, keepdim=True)
        torch.cuda.synchronize(dev)
    table = prof.key_averages()
    return (table.table(sort_by="self_cuda_time_total", row_limit=12) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=12))


def worker(rank, world, cfg):
    sys.path.insert(0, ROOT)
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from examples.deepseek_mla import ModelArgs, build_model

    dev = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg.get("dtype") or ("bfloat16" if cfg["device"] == "cuda" else "float32"))
    torch.set_grad_enabled(False)
    rows = []
    for c in cfg["dcp"]:
        rec = dict(c=c, world=world)
        try:
            torch._dynamo.reset()
            args = ModelArgs(dtype=dtype, tp_size=world, max_batch_size=cfg["batch"],
                             max_seq_len=cfg["prompt"] + cfg["steps"] + 8, positions=cfg.get("positions", "int"),
                             **cfg["model"])
            model = build_model(args, rank=rank, seed=1, device=dev)
            backend = DcpBackend(dcp_size=c, tp_size=world, inner=cfg["inner"])
            m = torch.compile(model, backend=backend, mode=cfg.get("mode"))
            g = torch.Generator(device="cpu")
            g.manual_seed(5)
            toks = torch.randint(0, args.vocab_size, (cfg["batch"], cfg["prompt"]), generator=g).to(dev)
            t0 = time.time()
            logits = m(toks, 0)
            nxt = logits.argmax(-1, keepdim=True)
            out_tokens = [nxt[:, 0].tolist()]
            pos = cfg["prompt"]
            times = []
            for i in range(cfg["steps"]):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                ts = time.perf_counter()
                # a device-tensor position keeps every step's shapes equal (CUDA graphs replay)
                logits = m(nxt, torch.tensor(pos, device=dev) if cfg.get("positions") == "tensor" else pos)
                nxt = logits.argmax(-1, keepdim=True)
                out_tokens.append(nxt[:, 0].tolist())  # host sync: the step is over
                times.append((time.perf_counter() - ts) * 1e3)
                pos += 1
            if cfg.get("profile") and dev.type == "cuda":
                # every rank runs the profiled steps (they hold collectives); rank 0 reports
                table = _profile_steps(m, nxt, pos, dev, tensor_positions=cfg.get("positions") == "tensor")
                if rank == 0:
                    rec["profile"] = table
            rec.update(first_call_s=time.time() - t0, step_ms_median=statistics.median(times[len(times) // 2:]),
                       step_ms_all=times, tokens=out_tokens, rewritten=backend.report.layers_rewritten,
                       graphs=len(backend.report.graphs), kv_full=backend.report.kv_bytes_full,
                       kv_local=backend.report.kv_bytes_local)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            rec["trace"] = traceback.format_exc()[-2000:]
        rows.append(rec)
        if rank == 0:
            print("model", {k: v for k, v in rec.items() if k not in ("trace", "tokens", "step_ms_all")}, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--dcp", default="1,2")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--inner", default="inductor")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    ap.add_argument("--profile", action="store_true", help="profile 3 decode steps on rank 0")
    ap.add_argument("--positions", default="int", choices=["int", "tensor"],
                    help="tensor: static-shape model (positions as a device tensor), for --mode reduce-overhead")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    from dcp_pass.testing import run_ranks

    world = a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    model = dict(dim=64, inter_dim=128, n_layers=2, n_dense_layers=2, n_heads=8, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128) if a.small else \
        dict(dim=2048, inter_dim=4096, n_layers=4, n_dense_layers=4, n_heads=32, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=32000)
    cfg = dict(dcp=[int(x) for x in a.dcp.split(",")], prompt=a.prompt, steps=a.steps, batch=a.batch,
               inner=a.inner, device=a.device, model=model, dtype=a.dtype, mode=a.mode, profile=a.profile,
               positions=a.positions)
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    res = run_ranks(worker, world, cfg, backend="nccl" if a.device == "cuda" else "gloo", timeout=a.timeout, env=env)
    rows = []
    for i, r0 in enumerate(res[0]):
        row = {k: v for k, v in r0.items() if k not in ("trace", "step_ms_all", "profile")}
        if r0.get("profile"):
            print(f"--- profile dcp={r0['c']} ---\n{r0['profile']}", flush=True)
        vals = [r[i].get("step_ms_median") for r in res if r[i].get("step_ms_median") is not None]
        if vals:
            row["step_ms_median"] = max(vals)
        rows.append(row)
    base = next((r for r in rows if r["c"] == 1 and "tokens" in r), None)
    for r in rows:
        if base is not None and "tokens" in r:
            r["same_tokens_as_dcp1"] = r["tokens"] == base["tokens"]
    out = dict(env=env_info(), cfg=cfg, rows=rows, raw=[[{k: v for k, v in x.items() if k != "tokens"} for x in r] for r in res])
    md = fmt_table(rows, [("dcp", "c"), ("world", "world"), ("step ms", lambda r: r.get("step_ms_median", "")),
                          ("first call s", lambda r: r.get("first_call_s", "")), ("layers rewritten", lambda r: r.get("rewritten", "")),
                          ("graphs", lambda r: r.get("graphs", "")), ("KV local/full", lambda r: f"{r['kv_local']}/{r['kv_full']}" if "kv_full" in r else ""),
                          ("same tokens", lambda r: r.get("same_tokens_as_dcp1", "")), ("error", lambda r: r.get("error", "")[:80])])
    out["table_md"] = md
    print(md, flush=True)
    if a.out:
        write_json(a.out, out)


if __name__ == "__main__":
    main()
