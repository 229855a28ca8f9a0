"""What the pass does to each Hugging Face family transformers ships, on CPU: a survey run by hand.

For each family, a tiny random model of transformers' own class (fp32, 2 layers where the
family allows, every MLP dense where the config allows) runs greedy `generate` on `--world`
gloo ranks under `model.compile(backend=DcpBackend(dcp_size=world, tp_size=1))`, once per
cache kind the family offers: "static" (`cache_implementation="static"`) and "dynamic" (HF's
default `DynamicCache`). Against the same model uncompiled it records, per family and cache kind:
attention layers rewritten / attention layers, tokens equal, the largest relative error of the
step logits, cache bytes per rank (the full cache's bytes -> the bytes this rank holds), graphs
compiled, graph breaks, and the report's reasons where a layer or graph is left unchanged.

    python benchmarks/hf_family_survey.py --out benchmarks/results/hf_family_survey_cpu.json
    python benchmarks/hf_family_survey.py --families mistral_large4 glm5_next --kinds static
    python benchmarks/hf_family_survey.py --table benchmarks/results/hf_family_survey_cpu.json

Each family runs in its own process group (one failing family does not stop the others); on
a 2-core machine the whole survey takes a few minutes. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Sizes every family shares where its config has the field (an absent field is skipped).
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              first_k_dense_replace=2, mlp_layer_types=["dense", "dense"], index_topk=8, index_head_dim=16,
              index_n_heads=2, max_position_embeddings=256, **NO_SPECIAL_TOKENS)
GQA = dict(num_key_value_heads=2, head_dim=16)


def _fields(cls) -> set:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def _config(cls_name: str, **extra):
    import transformers

    cls = getattr(transformers, cls_name)
    names = _fields(cls)
    return cls(**{k: v for k, v in {**COMMON, **extra}.items() if k in names})


# family -> (model class, config builder, cache kinds[, torch._dynamo.config settings for the compiled run])
def _families() -> dict[str, tuple]:
    both = ("static", "dynamic")

    def mistral_large4():
        import transformers

        text = _config("MistralLarge4TextConfig", head_dim=16, indexer_types=["full", "shared"],
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        return transformers.MistralLarge4Config(text_config=text.to_dict(), vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
            patch_size=4, image_size=16), tie_word_embeddings=False)

    def glm5_next():
        import transformers

        text = _config("Glm5NextTextConfig", qk_rope_head_dim=0, qk_nope_head_dim=16,
                       layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"],
                       linear_head_dim=16, linear_num_heads=4, index_kpool=4, hc_mult=2, hc_sinkhorn_iters=3)
        return transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
            projection_intermediate_size=64, patch_size=4, image_size=16))

    return {
        # MLA
        "deepseek_v2": ("DeepseekV2ForCausalLM", lambda: _config("DeepseekV2Config", topk_method="greedy"), both),
        "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: _config("DeepseekV3Config"), both),
        "deepseek_v32": ("DeepseekV32ForCausalLM", lambda: _config("DeepseekV32Config"), both),
        "glm_moe_dsa": ("GlmMoeDsaForCausalLM", lambda: _config("GlmMoeDsaConfig"), both),
        "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", lambda: _config("Glm4MoeLiteConfig"), both),
        "minicpm3": ("MiniCPM3ForCausalLM", lambda: _config("MiniCPM3Config"), both),
        "longcat_flash": ("LongcatFlashForCausalLM", lambda: _config(
            "LongcatFlashConfig", num_layers=1, ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2,
            zero_expert_num=0, head_dim=16), both),
        "mistral4": ("Mistral4ForCausalLM", lambda: _config("Mistral4Config"), both),
        "youtu": ("YoutuForCausalLM", lambda: _config("YoutuConfig"), both),
        "axk1": ("AXK1ForCausalLM", lambda: _config("AXK1Config"), both),
        "axk2": ("AXK2ForCausalLM", lambda: _config("AXK2Config"), both),
        "kimi_linear": ("KimiLinearForCausalLM", lambda: _config(
            "KimiLinearConfig", q_lora_rank=None, layer_types=["linear_attention", "full_attention"],
            num_local_experts=4, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4), both),
        "bailing_hybrid": ("BailingHybridForCausalLM", lambda: _config(
            "BailingHybridConfig", layer_group_size=2, num_local_experts=4, head_dim=16), both),
        # per-head K/V
        "llama": ("LlamaForCausalLM", lambda: _config("LlamaConfig", **GQA), both),
        "qwen2": ("Qwen2ForCausalLM", lambda: _config("Qwen2Config", **GQA), both),
        "qwen3": ("Qwen3ForCausalLM", lambda: _config("Qwen3Config", **GQA), both),
        "phi3": ("Phi3ForCausalLM", lambda: _config("Phi3Config"), both),
        "gpt_neox": ("GPTNeoXForCausalLM", lambda: _config("GPTNeoXConfig"), both),
        "mistral": ("MistralForCausalLM", lambda: _config("MistralConfig", sliding_window=None, **GQA), both),
        # sliding-window hybrids, sinks
        "gemma3": ("Gemma3ForCausalLM", lambda: _config(
            "Gemma3TextConfig", query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], **GQA), both),
        "gpt_oss": ("GptOssForCausalLM", lambda: _config(
            "GptOssConfig", intermediate_size=64, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            num_local_experts=2, num_experts_per_tok=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            **GQA), both),
        "hy_v4": ("HYV4ForCausalLM", lambda: _config("HYV4Config", hc_mult=2), both),
        # DSA with KV sharing / KDA hybrids with an indexer, and DeepSeek-V4
        "mistral_large4": ("MistralLarge4ForConditionalGeneration", mistral_large4, both),
        "glm5_next": ("Glm5NextForConditionalGeneration", glm5_next, both),
        # the same with the hint the report gives for its indexer's graph break followed
        "glm5_next_dynamic_shapes": ("Glm5NextForConditionalGeneration", glm5_next, ("static",),
                                     dict(capture_dynamic_output_shape_ops=True)),
        "deepseek_v4": ("DeepseekV4ForCausalLM", lambda: _config(
            "DeepseekV4Config", head_dim=32, sliding_window=4, index_topk=4, o_groups=2, o_lora_rank=16,
            hc_mult=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["moe", "moe"]), ("dynamic",)),
    }


def build(name: str, attn: str, seed: int = 0):
    import torch
    import transformers

    cls_name, make_config = _families()[name][:2]
    config = make_config()
    config._attn_implementation = attn
    for sub in ("text_config",):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).float().eval()
    with torch.no_grad():  # sink logits of a few units, different per head (their init is 0 or tiny)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model


PROMPTS = [[3, 5, 7, 9, 11, 2], [1, 2, 3, 4, 6, 8]]


def _generate(model, kind: str, new_tokens: int):
    import torch

    given = dict(cache_implementation="static") if kind == "static" else {}
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPTS), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **given)


def _cache_bytes(cache) -> tuple[int, int]:
    """(bytes of the storages of the cache's tensors as the model sees them (a striped tensor's
    at full size), bytes of memory this rank holds for them: its own storage, or its stripe)."""
    import torch

    from dcp_pass.state.memory import held_nbytes
    from dcp_pass.state.store import lookup_local_cache

    full = local = 0
    seen: set = set()
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            for t in tensors:
                if not isinstance(t, torch.Tensor) or id(t) in seen:
                    continue
                seen.add(id(t))
                full += t.untyped_storage().nbytes()
                entry = lookup_local_cache(t)
                local += held_nbytes(t) + (entry.local.untyped_storage().nbytes() if entry is not None else 0)
    return full, local


GENERIC = ("no absorbed-MLA attention in this graph", "no attention in this graph that the pass can rewrite")


def _reasons(report) -> list[str]:
    """Every distinct reason a layer or graph was left unchanged, the specific ones (a near
    miss, a kept layer, a graph break) before the generic "no attention in this graph"."""
    found: list[str] = []
    for g in report.graphs:
        items = [f"{layer.layer}: {layer.detail}" for layer in g.layers if not layer.rewritten]
        items += [f"near miss at {where}: {why}" for where, why in g.near_misses]
        if g.unchanged_reason and not g.layers:
            items.append(g.unchanged_reason)
        for item in items:
            if item not in found:
                found.append(item)
    return sorted(found, key=lambda why: why.startswith(GENERIC))


def _attention_layers(model) -> int:
    """Attention layers over a growing cache (not linear attention): the config's layer types."""
    config = getattr(model.config, "text_config", None) or model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers")
    types = getattr(config, "layer_types", None)
    if not types:
        return layers
    return sum(t not in ("linear_attention", "mamba", "conv") for t in types[:layers])


def survey_rank(rank: int, world: int, name: str, kinds: list, attn: str, new_tokens: int, inner: str):
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dcp_pass.backend import DcpBackend

    rows = []
    for kind in kinds:
        row: dict[str, Any] = dict(family=name, cache=kind, attn=attn, world=world)
        start = time.perf_counter()
        try:
            ref_model = build(name, attn)
            ref = _generate(ref_model, kind, new_tokens)
            row["full_bytes"] = _cache_bytes(ref.past_key_values)[0]
            torch._dynamo.reset()
            counters.clear()
            model = build(name, attn)
            backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
            model.compile(backend=backend)
            flags = _families()[name][3] if len(_families()[name]) > 3 else {}
            with torch._dynamo.config.patch(**flags):
                out = _generate(model, kind, new_tokens)
            row["tokens_equal"] = bool(torch.equal(out.sequences, ref.sequences))
            row["logits_err"] = max(((a - b).abs().max() / b.abs().max()).item()
                                    for a, b in zip(out.logits, ref.logits))
            full, local = _cache_bytes(out.past_key_values)
            row.update(cache_full_bytes=full, cache_local_bytes=local)
            row["graphs"] = len(backend.graphs)
            row["graph_breaks"] = sum(counters["graph_break"].values())
            row["break_reasons"] = sorted(counters["graph_break"])[:3]
            row["attention_layers"] = _attention_layers(model)
            row["rewritten_per_graph"] = [g.rewritten for g in backend.report.graphs]
            row["rewritten"] = max(row["rewritten_per_graph"], default=0)
            row["reasons"] = _reasons(backend.report)
        except Exception as e:  # noqa: BLE001 - a family's failure is a survey row
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
    return rows


def _short(reason: str, width: int = 160) -> str:
    """The reason without the source lines' code (their file:line stays), cut to `width`."""
    import re

    reason = re.sub(r" `[^`]*`", "", reason)
    return reason if len(reason) <= width else reason[:width - 3] + "..."


def table(rows: list) -> str:
    """A markdown table: one line per family and cache kind."""
    head = ("| family | cache | rewritten / attention layers | tokens equal | max rel. error | cache bytes per rank "
            "(full -> local) | graphs | graph breaks | reason where unchanged |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        family = r["family"] if r.get("attn", "eager") == "eager" else f"{r['family']} ({r['attn']})"
        if "error" in r:
            lines.append(f"| {family} | {r['cache']} | - | - | - | - | - | - | error: {_short(r['error'])} |")
            continue
        reason = _short(r["reasons"][0]) if r["reasons"] else ""
        lines.append(f"| {family} | {r['cache']} | {r['rewritten']} / {r['attention_layers']} | "
                     f"{'yes' if r['tokens_equal'] else 'NO'} | {r['logits_err']:.1e} | "
                     f"{r['cache_full_bytes']} -> {r['cache_local_bytes']} | {r['graphs']} | {r['graph_breaks']} | "
                     f"{reason.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from dcp_pass.testing import run_ranks

    families = _families()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(families), choices=list(families))
    parser.add_argument("--kinds", nargs="*", default=["static", "dynamic"], choices=["static", "dynamic"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa", "flex_attention"])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--out", default=None, help="JSON file to write (rows merged by family and cache kind)")
    parser.add_argument("--table", default=None, help="print the table of this JSON file and run nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = json.load(f)["rows"]
        order = list(_families())
        rows.sort(key=lambda r: (order.index(r["family"]) if r["family"] in order else len(order),
                                 r.get("attn", "eager") != "eager", r["cache"] != "static"))
        for row in rows:
            row["reasons"] = sorted(row.get("reasons", []), key=lambda why: why.startswith(GENERIC))
        print(table(rows))
        return

    rows = []
    for name in args.families:
        kinds = [k for k in args.kinds if k in families[name][2]]
        if not kinds:
            continue
        try:
            got = run_ranks(survey_rank, args.world, name, kinds, args.attn, args.new_tokens, args.inner,
                            timeout=1200.0)[0]
        except Exception as e:  # noqa: BLE001 - a rank that died is a survey row
            got = [dict(family=name, cache=k, attn=args.attn, world=args.world,
                        error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") for k in kinds]
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    if args.out:
        kept = []
        if os.path.exists(args.out):
            with open(args.out) as f:
                kept = json.load(f)["rows"]
        new_keys = {(r["family"], r["cache"], r["attn"]) for r in rows}
        merged = [r for r in kept if (r["family"], r["cache"], r.get("attn", "eager")) not in new_keys] + rows
        order = list(families)
        merged.sort(key=lambda r: (order.index(r["family"]) if r["family"] in order else len(order),
                                   r.get("attn", "eager") != "eager", r["cache"] != "static"))
        import torch
        import transformers

        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, transformers=transformers.__version__, rows=merged), f, indent=1)
        rows = merged
    print(table(rows))


if __name__ == "__main__":
    main()
