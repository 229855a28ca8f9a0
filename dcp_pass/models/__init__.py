"""Example models in plain PyTorch that know nothing about DCP, and their decode loops.

    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate

`deepseek_mla`: a small DeepSeek-V3-style transformer with absorbed MLA attention.
`hybrid_linear`: linear-attention layers interleaved with the same MLA layers.
`generate`: greedy and greedy speculative decoding loops.

Use `build_model(args)` (or `build_hybrid`) to get deterministic weights: constructing
`Transformer(args)` directly leaves its weights uninitialized (`torch.empty`).
"""
