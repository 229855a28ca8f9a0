"""Hugging Face generate(cache_implementation="static") under backend "dcp", against HF's own.

Every rank builds the same random model (dense layers), compiles it in place and times greedy
decode: per step, from the second new token's stopping check to the end of a generate of
`--steps` + 2 new tokens (prefill and compiles excluded: both lengths are warmed first); the
older measure, a long generate minus a short one, is kept beside it (it carries the prefill's
run-to-run spread: at 16K tokens a prefill's few ms of noise are a whole decode step). Families: `deepseek_v3`
(DeepseekV3ForCausalLM, MLA at DeepSeek-V3's attention widths, `--heads` query heads) and
`llama` (LlamaForCausalLM, GQA: `--heads` query heads over `--kv-heads`, head dim 128).

Variants, back to back in one process group: "hf" (no model.compile: generate compiles its own
decode step, inductor with CUDA graphs on CUDA: what a Hugging Face user already has) and
"dcp" (model.compile with the documented options and nothing else: `{"dcp_size": world}`, at
one GPU `{"dcp_size": 1, "fast_path": True}`); `--variants` adds "inductor" (plain
torch.compile) and "dcp absorbed off" (absorb_kv_b_proj=False). Each variant's tokens are
compared with the first's, and its cache bytes per rank recorded.

    python benchmarks/bench_hf.py --world 1 --family llama --prompt 16384 --batch 8 --out $OUT/hf.json

On CPU (gloo, a tiny model) it runs as a smoke test: `--device cpu --tiny`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def config(args):
    if args.family == "llama":
        from transformers import LlamaConfig

        sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=128) if args.tiny else dict(
            hidden_size=4096, intermediate_size=4096, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, head_dim=128, vocab_size=4096)
        return LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=1 << 20, bos_token_id=None,
                           eos_token_id=None, pad_token_id=None, **sizes)
    from transformers import DeepseekV3Config

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
                 qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=128) if args.tiny else dict(
        hidden_size=2048, intermediate_size=4096, num_attention_heads=args.heads, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=4096)
    return DeepseekV3Config(num_hidden_layers=args.layers, first_k_dense_replace=args.layers, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64,
                            num_key_value_heads=sizes["num_attention_heads"], max_position_embeddings=1 << 20,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None, **sizes)


def _generate(model, prompts, new, stopping_criteria=None):
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=new, do_sample=False, cache_implementation="static",
                              return_dict_in_generate=True, stopping_criteria=stopping_criteria)


def _stamped(model, prompts, new, device):
    """Decode time per step without the prefill: `generate` asks its stopping criteria once per
    new token, so the host clock at the second token's check starts the clock and the end of the
    generate (device synchronised) stops it; (new - 2) steps lie between. A long minus a short
    generate (`_timed`) also cancels the prefill, but carries its run-to-run spread."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    out = _generate(model, prompts, new, StoppingCriteriaList([Stamp()]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - stamps[1]) / (new - 2), out


def _timed(model, prompts, new, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = _generate(model, prompts, new)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


VARIANTS = {  # label -> DcpBackend options beyond dcp_size (None: HF's own compiled generate)
    "hf": None,
    "dcp": {},
    "inductor": {"dcp_size": 1, "fast_path": False},
    "dcp absorbed off": {"absorb_kv_b_proj": False},
}


def _profile(model, prompts, args, label, rank):
    """Top device kernels of a decode-only stretch (a long generate minus a short one) and the
    allocation history of a prefill (and one decode step), written to --profile-dir."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for new in (2, args.steps + 2):
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            _generate(model, prompts, new)
        tables[new] = {e.key: (e.device_time_total, e.count, e.self_cpu_time_total, e.cpu_time_total)
                       for e in prof.key_averages()}
    short, long = tables[2], tables[args.steps + 2]
    tag = f"{label.replace(' ', '_')}_r{rank}"
    with open(os.path.join(args.profile_dir, f"decode_kernels_{tag}.txt"), "w") as f:
        _write_per_step(f, short, long, args.steps, ((0, "device"), (2, "self cpu"), (3, "cpu total")),
                        "us of {} time per step | calls per step | name", 25, 1.0, lambda k: k[:150])
    _host_profile(model, prompts, args, tag)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    _generate(model, prompts, 2)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(os.path.join(args.profile_dir, f"prefill_peak_blocks_{tag}.txt"), "w") as f:
        f.write(_blocks_at_peak(snapshot))


def _host_profile(model, prompts, args, tag):
    """Host (Python) time per decode step by function: cProfile of a long generate minus a short
    one, so the prefill and the loop's set-up cancel; the top functions by own and by total time."""
    import cProfile
    import pstats

    stats = {}
    for new in (2, args.steps + 2):
        prof = cProfile.Profile()
        prof.enable()
        _generate(model, prompts, new)
        torch.cuda.synchronize()
        prof.disable()
        stats[new] = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    short, long = stats[2], stats[args.steps + 2]
    with open(os.path.join(args.profile_dir, f"decode_host_{tag}.txt"), "w") as f:
        _write_per_step(f, short, long, args.steps, ((2, "own"), (3, "total")),
                        "us of host {} time per step | calls per step | function", 40, 1e6,
                        lambda k: f"{'/'.join(k[0].split('/')[-2:])}:{k[1]} {k[2]}")


def _write_per_step(f, short, long, steps, columns, header, top, scale, label):
    """For each (column, what) of `columns`: the rows of a long run's table less a short run's,
    per decode step (column 1 of both tables is the call count), largest first."""
    for column, what in columns:
        per_step = {k: ((v[column] - short.get(k, (0, 0, 0, 0))[column]) / steps,
                        (v[1] - short.get(k, (0, 0, 0, 0))[1]) / steps) for k, v in long.items()}
        f.write(header.format(what) + "\n")
        for k, (value, n) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:top]:
            f.write(f"{scale * value:10.1f} | {n:6.1f} | {label(k)}\n")


def _blocks_at_peak(snapshot) -> str:
    """The allocations live at the highest point of the recorded trace, largest first, each with
    the innermost frames of its stack that are not torch's own."""
    live, total, best, at_best = {}, 0, -1, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > best:
            best, at_best = total, dict(live)
    lines = [f"peak of the trace: {best / 2**30:.2f} GiB above its start, {len(at_best)} blocks"]
    for event in sorted(at_best.values(), key=lambda e: -e["size"])[:25]:
        frames = [f"{fr['filename'].split('/')[-1]}:{fr['line']} {fr['name']}" for fr in event.get("frames", [])
                  if "/torch/" not in fr["filename"] or "_inductor" in fr["filename"]][:4]
        lines.append(f"{event['size'] / 2**30:8.3f} GiB  " + " <- ".join(frames))
    return "\n".join(lines) + "\n"


def _build(label, device, dtype, cfg, world, args):
    from transformers import AutoModelForCausalLM

    from dcp_pass.backend import DcpBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    backend = None
    if VARIANTS[label] is not None:
        # the documented call: dcp_size, and at one GPU fast_path; nothing else unless the variant says
        options = {"dcp_size": world, "tp_size": 1, **({"fast_path": True} if world == 1 else {})}
        options.update(VARIANTS[label])
        if args.inner != "inductor":
            options["inner"] = args.inner
        backend = DcpBackend(options)
        model.compile(backend=backend)
    return model, backend


def _capacity(device, dtype, cfg, world, args):
    """Per variant, the prompts (ascending) that prefill and decode 4 tokens with at most
    --cap-gib of GPU memory in this process, each with its peak; a variant stops at its first
    out-of-memory. One batch row, so the prompt is the request's whole context."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    rows = []
    for label in args.variants.split(","):
        model, backend = _build(label, device, dtype, cfg, world, args)
        for length in (int(x) for x in args.prompts.split(",")):
            prompts = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                out = _generate(model, prompts.to(device), 4)
                ok, error = True, ""
                del out
            except torch.OutOfMemoryError as e:
                ok, error = False, str(e).splitlines()[0][:200]
            except Exception as e:  # Dynamo wraps an out-of-memory inside a compile
                if "out of memory" not in str(e).lower():
                    raise
                ok, error = False, str(e).splitlines()[0][:200]
            rows.append(dict(variant=label, prompt=length, ok=ok, peak_gib=torch.cuda.max_memory_allocated(device)
                             / 2**30, error=error))
            print(f"rank {torch.distributed.get_rank()} {label}: prompt {length}: {'ok' if ok else 'OOM'}, "
                  f"peak {rows[-1]['peak_gib']:.2f} GiB", flush=True)
            if not ok:
                break
        if backend is not None:
            rows.append(dict(variant=label, report=backend.report.summary()))
        del model, backend
        torch.cuda.empty_cache()
    return rows


def _rank(rank: int, world: int, args):
    import torch._dynamo

    # the two timed lengths give two static cache sizes: two static graphs each, warmed first
    torch._dynamo.config.automatic_dynamic_shapes = False

    from dcp_pass.state.memory import held_nbytes
    from dcp_pass.state.store import lookup_local_cache

    # ranks beyond the GPU count share GPUs (gloo only: NCCL refuses two ranks on one device)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    cfg = config(args)
    cfg._attn_implementation = args.attn
    if args.cap_gib:
        return _capacity(device, dtype, cfg, world, args)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    prompts = prompts.to(device)
    rows, reference = [], None
    for label in args.variants.split(","):
        model, backend = _build(label, device, dtype, cfg, world, args)
        for new in (2, args.steps + 2):  # every compile of both cache lengths
            _generate(model, prompts, new)
        warmed = len(backend.graphs) if backend else 0
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0  # compiles included
        prefill_peak, prefill_s = 0.0, 0.0
        if device.type == "cuda":  # the peak of a prefill-only generate, the graphs compiled already
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            prefill_s, _ = _timed(model, prompts, 2, device)  # the prefill and one decode step
            prefill_peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        if args.profile_dir and device.type == "cuda":
            _profile(model, prompts, args, label, rank)
            for i, gm in enumerate(backend.graphs if backend else []):
                with open(os.path.join(args.profile_dir, f"graph{i}_{label.replace(' ', '_')}_r{rank}.py"), "w") as f:
                    f.write(gm.code)
        short, _ = _timed(model, prompts, 2, device)
        long, out = _timed(model, prompts, args.steps + 2, device)
        stamped, _ = _stamped(model, prompts, args.steps + 2, device)
        cache_bytes = 0
        cache = getattr(out, "cache", None) or out.past_key_values  # transformers 5.17 names it past_key_values
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                entry = lookup_local_cache(t)
                # memory behind the tensor (none for a full-shape stand-in) and its shard
                cache_bytes += held_nbytes(t) + (held_nbytes(entry.local) if entry else 0)
        if reference is None:
            reference = out.sequences
        rows.append(dict(variant=label, step_ms=1e3 * stamped,
                         step_ms_long_minus_short=1e3 * (long - short) / args.steps,
                         cache_bytes_per_rank=cache_bytes,
                         tokens_equal_first=bool(torch.equal(out.sequences, reference)),
                         graphs=len(backend.graphs) if backend else 0,
                         compiled_while_timed=len(backend.graphs) - warmed if backend else 0,
                         peak_gib=peak / 2**30, prefill_peak_above_model_gib=prefill_peak,
                         prefill_and_one_step_ms=1e3 * prefill_s if device.type == "cuda" else 0.0,
                         layers=[layer.detail for g in backend.report.graphs for layer in g.layers
                                 if layer.rewritten][:1] if backend else []))
        del model, out, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--inner", default="inductor")
    parser.add_argument("--family", default="deepseek_v3", choices=("deepseek_v3", "llama"))
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="llama: key/value heads")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--variants", default="hf,dcp", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=None)
    parser.add_argument("--comm", default=None, choices=("nccl", "gloo"),
                        help="process group (default: nccl on CUDA; gloo lets ranks share a GPU)")
    parser.add_argument("--cap-gib", type=float, default=0.0,
                        help="capacity mode: which of --prompts fit this much GPU memory per rank, B=1")
    parser.add_argument("--prompts", default="32768,65536,98304,131072", help="capacity mode: prompt lengths")
    parser.add_argument("--profile-dir", default=None, help="write decode kernel tables and prefill memory snapshots")
    args = parser.parse_args()

    from dcp_pass.testing import run_ranks

    backend = args.comm or ("nccl" if args.device == "cuda" else "gloo")
    results = run_ranks(_rank, args.world, args, backend=backend, timeout=3000)
    for row in results[0] if not args.cap_gib else []:
        print(f"{row['variant']:>16}: {row['step_ms']:8.2f} ms/step ({row['step_ms_long_minus_short']:.2f} long minus "
              f"short), cache {row['cache_bytes_per_rank'] / 2**20:8.2f} "
              f"MiB/rank, tokens == first: {row['tokens_equal_first']}, graphs {row['graphs']} "
              f"({row['compiled_while_timed']} while timed), peak {row['peak_gib']:.2f} GiB, prefill + 1 step "
              f"{row['prefill_and_one_step_ms']:.0f} ms at {row['prefill_peak_above_model_gib']:.2f} GiB above the "
              f"model")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), ranks=results), f, indent=1)


if __name__ == "__main__":
    main()
