"""Tiny random Hugging Face models for tests: fp32, CPU, a few hundred kB of weights.

Each builder returns an unmodified transformers model in eval mode, seeded, with
`attn_implementation` "eager" or "sdpa". MoE is off (every MLP is dense) so the
graphs hold attention and cache code, not router loops. No special token ids are
set, so `generate` never stops early on a random model: `max_new_tokens` decides
the length. Tests import this module only after `pytest.importorskip("transformers")`.
"""
from __future__ import annotations

import torch

HIDDEN = 64
LAYERS = 2
HEADS = 4
VOCAB = 128
KV_LORA_RANK = 32
QK_ROPE_HEAD_DIM = 16
QK_NOPE_HEAD_DIM = 16
V_HEAD_DIM = 16
MAX_POSITIONS = 256

# No bos/eos/pad: a random model would otherwise stop at an eos it happens to sample,
# and Kimi's default pad id (163839) lies outside a tiny vocabulary.
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def deepseek_v3_config(**overrides):
    """DeepseekV3Config: MLA with q_lora, all layers dense (first_k_dense_replace = layers)."""
    from transformers import DeepseekV3Config

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=48,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        first_k_dense_replace=LAYERS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def kimi_linear_config(**overrides):
    """KimiLinearConfig: layer 0 is KDA (linear attention), layer 1 is MLA (NoPE), both MLPs dense."""
    from transformers import KimiLinearConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense"] * LAYERS,
        num_local_experts=4,
        num_experts_per_tok=2,
        linear_head_dim=16,
        linear_num_heads=HEADS,
        linear_conv_kernel_dim=4,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return KimiLinearConfig(**fields)


def llama_gqa_config(**overrides):
    """LlamaConfig: GQA with 4 query heads over 2 KV heads, head_dim 16."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def gpt_oss_config(**overrides):
    """GptOssConfig: GQA (4 query heads over 2 KV heads) with a learned sink logit per head,
    layer 0 sliding-window (4 positions), layer 1 full attention, 2 experts (top-1)."""
    from transformers import GptOssConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return GptOssConfig(**fields)


def gemma3_config(**overrides):
    """Gemma3TextConfig: GQA (4 query heads over 2 KV heads), layer 0 sliding-window (4
    positions), layer 1 full attention, as Gemma 3 interleaves them."""
    from transformers import Gemma3TextConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        query_pre_attn_scalar=HIDDEN // HEADS,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return Gemma3TextConfig(**fields)


def hy_v4_config(**overrides):
    """HYV4Config: MLA (latent re-expanded per head) with DSA top-k (layer 0 runs the indexer,
    layer 1 shares its top-k), sinks, hyper-connections of width 2, both MLPs dense."""
    from transformers import HYV4Config

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=48,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        mlp_layer_types=["dense"] * LAYERS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        hc_mult=2,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return HYV4Config(**fields)


def deepseek_v4_config(**overrides):
    """DeepseekV4Config: one layer of each kind (sliding window, CSA with its indexer, HCA), shared-KV
    MQA with sinks, window 8, compress rates 4 and 8, hyper-connections of width 2, tiny MoE
    (V4 has no dense MLP: its first layer routes by hash)."""
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=2,
        hc_sinkhorn_iters=4,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=2,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def llama_mha_config(**overrides):
    """LlamaConfig: plain MHA (as many KV heads as query heads)."""
    return llama_gqa_config(**{"num_key_value_heads": HEADS, **overrides})


def phi3_config(**overrides):
    """Phi3Config: MHA with a fused qkv projection."""
    from transformers import Phi3Config

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return Phi3Config(**fields)


def gpt_neox_config(**overrides):
    """GPTNeoXConfig: MHA, partial rotary, parallel residual."""
    from transformers import GPTNeoXConfig

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    fields.update(overrides)
    return GPTNeoXConfig(**fields)


def mistral_large4_config(**overrides):
    """MistralLarge4Config (the text model of MistralLarge4ForConditionalGeneration, a one-block
    vision tower beside it): MLA over a latent cache with DSA top-k 8, 3 layers: layer 1 reuses
    layer 0's cache and top-k (KV sharing, indexer "shared"), layer 2 is NoPE with its own
    cache and indexer; all MLPs dense."""
    from transformers import MistralLarge4Config, MistralLarge4TextConfig

    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        head_dim=QK_ROPE_HEAD_DIM,
        first_k_dense_replace=3,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        indexer_types=["full", "shared", "full"],
        kv_source_layers=[0, 0, 2],
        no_rope_layers=[1, 1, 0],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    text.update(overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  patch_size=4, image_size=16)
    return MistralLarge4Config(text_config=MistralLarge4TextConfig(**text).to_dict(), vision_config=vision,
                               tie_word_embeddings=False)


def glm5_next_config(**overrides):
    """Glm5NextConfig (the text model of Glm5NextForConditionalGeneration, a one-block vision
    tower beside it): layer 0 KDA (linear attention), layer 1 NoPE MLA over a latent cache with
    a pooled DSA indexer (pools of 4, top-k 8), hyper-connections of width 2, MLPs dense."""
    from transformers import Glm5NextConfig, Glm5NextTextConfig

    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=48,
        qk_rope_head_dim=0,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        mlp_layer_types=["dense"] * LAYERS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "indexed_attention"],
        indexer_types=["full"] * LAYERS,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        index_kpool=4,
        linear_head_dim=16,
        linear_num_heads=HEADS,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        max_position_embeddings=MAX_POSITIONS,
        **_NO_SPECIAL_TOKENS,
    )
    text.update(overrides)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HIDDEN,
                  projection_intermediate_size=64, patch_size=4, image_size=16)
    return Glm5NextConfig(text_config=Glm5NextTextConfig(**text).to_dict(), vision_config=vision)


CONFIGS = {
    "deepseek_v3": deepseek_v3_config,
    "kimi_linear": kimi_linear_config,
    "llama_gqa": llama_gqa_config,
    "gpt_oss": gpt_oss_config,
    "gemma3": gemma3_config,
    "hy_v4": hy_v4_config,
    "deepseek_v4": deepseek_v4_config,
    "llama_mha": llama_mha_config,
    "phi3": phi3_config,
    "gpt_neox": gpt_neox_config,
    "mistral_large4": mistral_large4_config,
    "glm5_next": glm5_next_config,
}


MODEL_CLASSES = {  # name -> transformers' class, looked up when used (older releases lack the newest)
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "llama_gqa": "LlamaForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "llama_mha": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "mistral_large4": "MistralLarge4ForConditionalGeneration",
    "glm5_next": "Glm5NextForConditionalGeneration",
}


def model_class(name: str):
    import transformers

    return getattr(transformers, MODEL_CLASSES[name])


def tiny_model(name: str, attn_implementation: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    """A seeded tiny model `name` (a key of CONFIGS) in eval mode."""
    config = CONFIGS[name](**overrides)
    config._attn_implementation = attn_implementation
    if getattr(config, "text_config", None) is not None:  # a multimodal model's language half
        config.text_config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class(name)(config).to(dtype).eval()
    with torch.no_grad():  # sink logits of a few units, different per head (their init is 0 or tiny)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model
