"""Whole-model decode with the compile pass: dcp_pass/models/deepseek_mla.py, torch.compile(backend="dcp").

Every rank builds the unmodified example model (TP over all ranks, dense layers only so
the graph count stays small) at DeepSeek-V3 sizes with random weights, fills its caches
with `ctx` random rows (the state after a prefill), compiles it with
DcpBackend(dcp_size=c) (inductor inside, optionally mode="reduce-overhead" for CUDA
graphs) and times greedy decode steps, one host sync per step. Every (ctx, mode, DCP)
variant runs back to back in one process group; rank 0's tokens are compared with
DCP=1's. Capacity is computed from measured memory: what a rank holds besides its cache,
and the cache bytes per token at that DCP size.

    python benchmarks/bench_model.py --world 2 --dcp 1,2 --ctx 8192,131072 --batch 8 \
        --modes default,reduce-overhead --out model.json

`--project-before-merge 1,0` times each DCP > 1 variant with the value up-projection
before the exchange (v_head_dim columns exchanged) and after it (the latent width).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import NO_MULTICAST_ENV, ROOT, env_info, fmt_table, write_json  # noqa: E402


def _profile_steps(step, nxt, pos, dev, steps=3):
    """Top host and device ops of a few decode steps (where the step time goes), then the
    Python functions by own time over as many more steps (where the host time goes)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            nxt = step(nxt, pos + i)
        torch.cuda.synchronize(dev)
    table = prof.key_averages()
    py = cProfile.Profile()
    py.enable()
    for i in range(steps):
        nxt = step(nxt, pos + steps + i)
    torch.cuda.synchronize(dev)
    py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(30)
    return (table.table(sort_by="self_cuda_time_total", row_limit=12) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=25) + "\n" + text.getvalue())


def random_model(args, rank, dev, seed):
    """The example Transformer with random weights drawn on the device.

    build_model draws TP-independent full tensors on the CPU, which takes minutes at real
    sizes. A benchmark needs less: weights that TP replicates (norms, the latent and
    q down-projections) equal on every rank, each rank's shards fixed by (seed, rank),
    and build_model's scaling (1/sqrt(full fan-in)), so activations stay O(1).
    """
    from dcp_pass.models.deepseek_mla import ParallelEmbedding, RMSNorm, Transformer, _shard_dim

    with torch.device(dev):
        model = Transformer(args, rank)
    g = torch.Generator(device=dev)
    for i, (name, p) in enumerate(model.named_parameters()):
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        shard_dim = _shard_dim(owner)
        g.manual_seed(seed * 100003 + i * 101 + (rank if shard_dim is not None else 0))
        p.data.normal_(generator=g)
        if isinstance(owner, RMSNorm):
            p.data.mul_(0.1).add_(1.0)
        elif not isinstance(owner, ParallelEmbedding) and p.dim() >= 2:
            fan_in = p.shape[-1] * (owner.tp_size if shard_dim == 1 else 1)
            p.data.div_(math.sqrt(fan_in))
    return model.eval().requires_grad_(False)


def cache_buffers(model):
    """The latent (and separate rotary) cache buffers of every layer."""
    for layer in model.layers:
        for name in ("kv_cache", "pe_cache"):
            buf = getattr(layer.attn, name, None)
            if buf is not None:
                yield buf


def fill_caches(model, n_tokens, seed):
    """Random latent/rotary rows at positions [0, n_tokens): the state after a prefill.

    A long prompt cannot be prefilled through the example model (its attention
    materialises [b, h, s, s] scores), and decode speed does not depend on how the rows
    got there. Done before the first compiled call: the pass keeps rows already written
    when it stripes a cache.
    """
    g = torch.Generator(device=model.freqs_cis.device)
    g.manual_seed(seed)
    for buf in cache_buffers(model):
        buf[:, :n_tokens].normal_(generator=g)


def cache_bytes(model, report):
    """Bytes of KV cache this rank holds: the pass's local shards, or the full buffers."""
    if report.layers_rewritten:
        return report.kv_bytes_local
    return sum(buf.numel() * buf.element_size() for buf in cache_buffers(model))


def run_variant(rank, world, cfg, c, mode, ctx, dev, dtype):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs

    rec = dict(c=c, world=world, mode=mode or "default", ctx=ctx, batch=cfg["batch"], positions=cfg["positions"])
    torch._dynamo.reset()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    tensor_pos = cfg["positions"] == "tensor"
    # a multiple of 64: cuBLAS bmm over an odd-length cache is ~1.7x slower (FIELD_NOTES), and
    # a baseline must not be slowed by the shape it was given
    max_seq = -(-(ctx + cfg["warmup"] + cfg["steps"] + 8) // 64) * 64
    args = ModelArgs(dtype=dtype, tp_size=world, max_batch_size=cfg["batch"], max_seq_len=max_seq,
                     positions=cfg["positions"], **cfg["model"])
    model = random_model(args, rank, dev, seed=1)
    fill_caches(model, ctx, seed=7)
    # CUDA graphs exactly when the mode asks for them (the option's "auto" would turn them on
    # for every CUDA run, the "default" rows included)
    replicate = cfg.get("replicate_q")  # None: the option's default (replicate where the layer allows it)
    if replicate is not None and c > 1:
        rec["replicate_q_proj"] = replicate
    inner_options = cfg.get("inner_options") or {}
    if inner_options:
        rec["inner_options"] = inner_options
    extra = dict(cfg.get("dcp_options") or {}) if c > 1 else {}
    if extra:
        rec["dcp_options"] = extra
    if replicate is not None and c > 1:
        extra["replicate_q_proj"] = replicate
    if cfg.get("fast_path") and c == 1:  # the single-GPU fast path: the pass's kernel at DCP=1
        rec["fast_path"] = True
        extra["fast_path"] = True
        if cfg.get("fast_path_variant"):
            rec["fast_path_options"] = dict(cfg["fast_path_variant"])
            extra.update(cfg["fast_path_variant"])
    project = cfg.get("project_before_merge")  # None: the option's default (where exact)
    if project is not None and c > 1:
        rec["project_before_merge"] = project
        extra["project_before_merge"] = project
    backend = DcpBackend(dcp_size=c, tp_size=world, inner=cfg["inner"], inner_options=inner_options,
                         cudagraphs="auto" if mode not in (None, "default") else False, **extra)
    m = torch.compile(model, backend=backend, mode=mode)
    g = torch.Generator(device="cpu")
    g.manual_seed(5)
    first = torch.randint(0, args.vocab_size, (cfg["batch"], 1), generator=g).to(dev)

    def forward(tok, pos):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        # a device-tensor position keeps every step's shapes equal (CUDA graphs replay)
        return m(tok, torch.tensor(pos, device=dev) if tensor_pos else pos)

    def step(tok, pos):
        return forward(tok, pos).argmax(-1, keepdim=True)

    t0 = time.time()
    nxt = step(first, ctx)
    rec["first_call_s"] = time.time() - t0
    # the first step's logits again (same inputs, same cache row rewritten with the same
    # values): kept to set DCP's deviation against the margin between the top two tokens
    logits0 = forward(first, ctx).float()
    top2 = logits0.topk(2, dim=-1).values
    rec["top2_gap_step0"] = (top2[:, 0] - top2[:, 1]).tolist()
    rec["_logits0"] = logits0.cpu()
    out_tokens = [nxt[:, 0].tolist()]
    pos = ctx + 1
    times, host, ends = [], [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        sync(dev)
        ts = time.perf_counter()
        nxt = step(nxt, pos)
        th = time.perf_counter()  # every launch of the step is issued: host time
        out_tokens.append(nxt[:, 0].tolist())  # host sync: the step is over
        if i >= cfg["warmup"]:
            times.append((time.perf_counter() - ts) * 1e3)
            host.append((th - ts) * 1e3)
            ends.append(pos + 1)  # the cache length this step attended over
        pos += 1
    # host-bound when the launches take about as long as the step
    rec["host_ms_median"] = statistics.median(host)
    # cuBLAS bmm over cache[:, :end] is parity-dependent: report both parities of end_pos
    for name, parity in (("even", 0), ("odd", 1)):
        sel = [t for t, e in zip(times, ends) if e % 2 == parity]
        rec[f"step_ms_{name}"] = statistics.median(sel) if sel else None
    if cfg.get("profile") and dev.type == "cuda":
        # every rank runs the profiled steps (they hold collectives); rank 0 reports
        table = _profile_steps(step, nxt, pos, dev)
        if rank == 0:
            rec["profile"] = table
    med = statistics.median(times)
    rec.update(step_ms_median=med, step_ms_all=times, tokens_per_s=cfg["batch"] * 1e3 / med, tokens=out_tokens,
               rewritten=backend.report.layers_rewritten, graphs=len(backend.report.graphs),
               projected_rewrites=sum(p.matched_count for g in backend.report.graphs for p in g.passes
                                    if p.name == "project_before_merge"),
               kv_full=backend.report.kv_bytes_full, kv_local=backend.report.kv_bytes_local)
    ceilings = cfg.get("ceilings")
    if ceilings:
        rec.update(step_floor(model, args, ctx + cfg["warmup"] + cfg["steps"] // 2, cfg["batch"], c, ceilings))
        rec["floor_frac"] = rec["floor_ms"] / med
    if dev.type == "cuda":
        # capacity: what this rank holds besides the cache stays; the rest of 90 % of the
        # GPU can hold cache rows at this variant's bytes per token (analytic, measured memory)
        kv = cache_bytes(model, backend.report)
        per_token = kv / (cfg["batch"] * args.max_seq_len)
        peak = torch.cuda.max_memory_allocated(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        rec.update(kv_bytes_rank=kv, kv_bytes_per_token=per_token, peak_mem_gib=peak / 2 ** 30,
                   max_cache_tokens=int((0.9 * total - (peak - kv)) / per_token))
        torch.cuda.reset_peak_memory_stats(dev)
    return rec


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_ceilings(dev) -> dict:
    """Copy bandwidth (bytes read + written) and the bf16 matmul rate, measured on this GPU."""
    import triton.testing

    src = torch.empty(2 ** 31, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * 2 ** 31 / (copy_ms * 1e-3), "matmul_flops_per_s": 2 * 8192 ** 3 / (mm_ms * 1e-3)}


def step_floor(model, args, ctx: int, batch: int, c: int, ceilings: dict) -> dict:
    """The decode step's floor on this rank: every weight byte and this rank's KV bytes read
    once at the copy bandwidth, the attention's flops at the matmul rate (the larger of the
    attention's two terms: its reads and its products overlap), the weights' reads added."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    local_ctx = -(-ctx // c)
    d_lat, d_rope = args.kv_lora_rank, args.qk_rope_head_dim
    heads = args.n_heads  # every rank of the DCP group attends all the group's heads
    kv_bytes = args.n_layers * batch * local_ctx * (d_lat + d_rope) * 2
    attn_flops = args.n_layers * 2 * batch * heads * local_ctx * (d_lat + d_rope + d_lat)
    bw, mm = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    floor_s = weight_bytes / bw + max(kv_bytes / bw, attn_flops / mm)
    return {"floor_ms": floor_s * 1e3, "weight_bytes": weight_bytes, "kv_bytes_step": kv_bytes,
            "attn_flops_step": attn_flops, **{f"ceiling_{k}": v for k, v in ceilings.items()}}


def worker(rank, world, cfg):
    sys.path.insert(0, ROOT)
    dev = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        cfg = dict(cfg, ceilings=measure_ceilings(dev))
    dtype = getattr(torch, cfg.get("dtype") or ("bfloat16" if cfg["device"] == "cuda" else "float32"))
    torch.set_grad_enabled(False)
    rows = []
    for ctx in cfg["ctx"]:
        for mode in cfg["modes"]:
            for c, replicate, project, inner_options, fast, fast_options in [
                    (c, r, p, io, f, fo) for c in cfg["dcp"] for io in cfg["inner_options"]
                    for r in (cfg["replicate"] if c > 1 else [None])
                    for p in (cfg["project_before_merge"] if c > 1 else [None])
                    for f in (cfg["fast_path"] if c == 1 else [False])
                    for fo in (cfg["fast_path_options"] if f else [{}])]:
                try:
                    rec = run_variant(rank, world, dict(cfg, replicate_q=replicate, project_before_merge=project,
                                                        inner_options=inner_options, fast_path=fast,
                                                        fast_path_variant=fast_options), c,
                                      None if mode == "default" else mode, ctx, dev, dtype)
                except Exception as e:  # noqa: BLE001
                    rec = dict(c=c, world=world, mode=mode, ctx=ctx, batch=cfg["batch"],
                               **({"inner_options": inner_options} if inner_options else {}),
                               **({"project_before_merge": project} if project is not None else {}), error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-2000:])
                rec["t_end"] = time.strftime("%H:%M:%S")
                rows.append(rec)
                # a step ends when its slowest rank ends; rank 0 keeps the row on disk at once,
                # so a run cut short by its time limit still leaves every finished variant
                if world > 1 and torch.distributed.is_initialized():
                    meds = [None] * world
                    torch.distributed.all_gather_object(meds, rec.get("step_ms_median"))
                    if all(v is not None for v in meds):
                        rec["step_ms_ranks"] = meds
                if rank == 0:
                    print("model", {k: v for k, v in rec.items() if k not in ("trace", "tokens", "step_ms_all", "profile")},
                          flush=True)
                    if cfg.get("partial"):
                        with open(cfg["partial"], "a") as f:
                            f.write(json.dumps({k: v for k, v in rec.items() if k != "profile" and not k.startswith("_")},
                                               default=str) + "\n")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--dcp", default="1,2")
    ap.add_argument("--ctx", default="2048", help="comma list: tokens already in the cache when decode starts")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps (CUDA-graph recording)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--inner", default="inductor")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="v3-4l", choices=["v3-4l", "mid", "small"],
                    help="v3-4l: DeepSeek-V3 sizes, 4 dense layers; mid: dim 2048, 32 heads; small: CPU dry run")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--modes", default="default", help="comma list of torch.compile modes: default, reduce-overhead")
    ap.add_argument("--profile", action="store_true", help="profile 3 decode steps (rank 0 reports)")
    ap.add_argument("--positions", default="tensor", choices=["int", "tensor"],
                    help="tensor: static-shape model (positions as a device tensor; one decode graph, CUDA graphs "
                         "replay); int: the DeepSeek reference's int start_pos")
    ap.add_argument("--replicate-q", default="default",
                    help="comma list for DCP > 1 variants: default (the option's choice), 1 (replicated q "
                         "projection), 0 (one all-gather of the query heads)")
    ap.add_argument("--fast-path", default="0",
                    help="comma list of 0/1: DCP=1 variants without / with option fast_path (the pass's attention "
                         "kernel, device positions and CUDA graphs at dcp_size=1)")
    ap.add_argument("--fast-path-options", default="{}",
                    help="';'-separated JSON dicts of more `dcp` options, each a variant of the fast-path rows, "
                         "e.g. '{};{\"attn_backend\": \"flashinfer\"}'")
    ap.add_argument("--project-before-merge", default="default",
                    help="comma list for DCP > 1 variants: default (the option's choice: where exact), 1 (the "
                         "value projection before the exchange, v_head_dim columns), 0 (after it, the latent width)")
    ap.add_argument("--inner-options", default="{}",
                    help="';'-separated JSON dicts of inner-compiler options, each a variant of every row "
                         "(DCP=1 included), e.g. '{};{\"cpp_wrapper\": true}'")
    ap.add_argument("--dcp-options", default="{}",
                    help="JSON dict of more `dcp` options for the DCP > 1 variants, e.g. '{\"static_positions\": true}' "
                         "(a CPU run of the device-position graph)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    from dcp_pass.testing import run_ranks

    world = a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    model = {
        "small": dict(dim=64, inter_dim=128, n_layers=2, n_dense_layers=2, n_heads=8, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128),
        "mid": dict(dim=2048, inter_dim=4096, n_layers=4, n_dense_layers=4, n_heads=32, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=32000),
        "v3-4l": dict(dim=7168, inter_dim=18432, n_layers=4, n_dense_layers=4, n_heads=128, q_lora_rank=1536,
                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280),
    }[a.model]
    cfg = dict(dcp=[int(x) for x in a.dcp.split(",")], ctx=[int(x) for x in a.ctx.split(",")], steps=a.steps,
               warmup=a.warmup, batch=a.batch, inner=a.inner, device=a.device, model=model, model_name=a.model,
               dtype=a.dtype, modes=a.modes.split(","), profile=a.profile, positions=a.positions,
               replicate=[{"default": None, "1": True, "0": False}[x] for x in a.replicate_q.split(",")],
               project_before_merge=[{"default": None, "1": True, "0": False}[x]
                                     for x in a.project_before_merge.split(",")],
               inner_options=[json.loads(x) for x in a.inner_options.split(";")],
               fast_path=[x == "1" for x in a.fast_path.split(",")],
               fast_path_options=[json.loads(x) for x in a.fast_path_options.split(";")],
               dcp_options=json.loads(a.dcp_options),
               partial=(a.out + ".partial.jsonl") if a.out else None)
    if cfg["partial"] and os.path.exists(cfg["partial"]):
        os.remove(cfg["partial"])
    try:
        res = run_ranks(worker, world, cfg, backend="nccl" if a.device == "cuda" else "gloo", timeout=a.timeout,
                        env=NO_MULTICAST_ENV)
        rank0 = res[0]
    except TimeoutError as e:  # keep what finished (rank 0 wrote each variant as it ended)
        if not (cfg["partial"] and os.path.exists(cfg["partial"])):
            raise
        print(f"{e}; writing the variants that finished", flush=True)
        with open(cfg["partial"]) as f:
            rank0 = [json.loads(line) for line in f]
    rows = []
    for r0 in rank0:
        row = {k: v for k, v in r0.items() if k not in ("trace", "step_ms_all", "profile")}
        if r0.get("profile"):
            print(f"--- profile dcp={r0['c']} mode={r0['mode']} ctx={r0['ctx']} ---\n{r0['profile']}", flush=True)
        if r0.get("step_ms_ranks"):  # a step ends when its slowest rank ends
            row["step_ms_median"] = max(r0["step_ms_ranks"])
        if "step_ms_median" in row:
            row["tokens_per_s"] = row["batch"] * 1e3 / row["step_ms_median"]
        rows.append(row)
    for r in rows:  # every variant against DCP=1 without CUDA graphs at the same context
        base = next((b for b in rows if b["c"] == 1 and not b.get("fast_path") and b["ctx"] == r["ctx"]
                     and "tokens" in b), None)
        same_mode = next((b for b in rows if b["c"] == 1 and not b.get("fast_path") and b["ctx"] == r["ctx"]
                          and b["mode"] == r["mode"] and "step_ms_median" in b), None)
        if base is not None and "tokens" in r:
            r["same_tokens_as_dcp1"] = r["tokens"] == base["tokens"]
        if base is not None and "_logits0" in r and "_logits0" in base:
            # largest logit deviation of the first step vs DCP=1, and per request whether the
            # first token differs although DCP=1's top-2 margin exceeds twice that deviation
            diff = (r["_logits0"] - base["_logits0"]).abs().amax(-1)
            r["step0_max_logit_diff"] = diff.max().item()
            r["step0_decisive_mismatch"] = sum(
                int(a != b and g > 2 * d) for a, b, g, d in
                zip(r["tokens"][0], base["tokens"][0], base["top2_gap_step0"], diff.tolist()))
        if same_mode is not None and "step_ms_median" in r and (r["c"] != 1 or r.get("fast_path")):
            r["speedup_vs_dcp1"] = same_mode["step_ms_median"] / r["step_ms_median"]
        # against the best the user could run without DCP: plain torch.compile (DCP=1 leaves
        # every graph unchanged) in its fastest mode, at its faster end_pos parity
        plain = [min(v for v in (b.get("step_ms_even"), b.get("step_ms_odd"), b["step_ms_median"]) if v)
                 for b in rows if b["c"] == 1 and not b.get("fast_path") and b["ctx"] == r["ctx"]
                 and "step_ms_median" in b]
        if plain and "step_ms_median" in r:
            r["plain_best_ms"] = min(plain)
            r["speedup_vs_plain"] = min(plain) / r["step_ms_median"]
    out = dict(env=env_info(), cfg=cfg,
               rows=[{k: v for k, v in r.items() if k != "tokens" and not k.startswith("_")} for r in rows])
    md = fmt_table(rows, [
        ("ctx", "ctx"), ("B", "batch"), ("mode", "mode"), ("dcp", "c"),
        ("replicate q", lambda r: {True: "1", False: "0"}.get(r.get("replicate_q_proj"), "")),
        ("fast path", lambda r: (json.dumps(r["fast_path_options"]) if r.get("fast_path_options") else "1")
         if r.get("fast_path") else ""),
        ("project before merge", lambda r: {True: "1", False: "0"}.get(r.get("project_before_merge"), "")),
        ("floor ms", lambda r: r.get("floor_ms", "")), ("of floor", lambda r: r.get("floor_frac", "")),
        ("projected rewrites", lambda r: r.get("projected_rewrites", "")),
        ("inner options", lambda r: json.dumps(r["inner_options"]) if r.get("inner_options") else ""), ("step ms", lambda r: r.get("step_ms_median", "")),
        ("tokens/s", lambda r: r.get("tokens_per_s", "")), ("speedup vs DCP=1", lambda r: r.get("speedup_vs_dcp1", "")),
        ("even ms", lambda r: r.get("step_ms_even") or ""), ("odd ms", lambda r: r.get("step_ms_odd") or ""),
        ("host ms", lambda r: r.get("host_ms_median") or ""),
        ("speedup vs plain best", lambda r: r.get("speedup_vs_plain", "")),
        ("KV MiB/rank", lambda r: r["kv_bytes_rank"] / 2 ** 20 if "kv_bytes_rank" in r else ""),
        ("max cache tokens/rank group", lambda r: r.get("max_cache_tokens", "")),
        ("first call s", lambda r: r.get("first_call_s", "")), ("rewrites", lambda r: r.get("rewritten", "")),
        ("graphs", lambda r: r.get("graphs", "")), ("same tokens", lambda r: r.get("same_tokens_as_dcp1", "")),
        ("step-0 logit diff", lambda r: r.get("step0_max_logit_diff", "")),
        ("decisive mismatches", lambda r: r.get("step0_decisive_mismatch", "")),
        ("error", lambda r: r.get("error", "")[:80])])
    out["table_md"] = md
    print(md, flush=True)
    if a.out:
        write_json(a.out, out)


if __name__ == "__main__":
    main()
