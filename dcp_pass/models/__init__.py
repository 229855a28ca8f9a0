"""Example models in plain PyTorch that know nothing about DCP, and their decode loops.

    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate

`deepseek_mla`: a small DeepSeek-V3-style transformer with absorbed MLA attention.
`hybrid_linear`: linear-attention layers interleaved with the same MLA layers.
`deepseek_v32`: a small DeepSeek-V3.2-Exp-style model (MHA prefill, absorbed decode, the
lightning indexer's top-k mask), structured as the official inference code; it needs an
initialized process group at every world size (its indexer calls `dist.broadcast`).
`deepseek_v4`: a small DeepSeek-V4-style model (sliding-window ring and compressed entries in
one buffer per layer, compressors, lightning indexer, attention sinks, hyper-connections),
structured as the official inference code; `cache_bytes_per_token` gives its cache bytes.
`generate`: greedy and greedy speculative decoding loops.

Use `build_model(args)` (or `build_hybrid`) to get deterministic weights: constructing
`Transformer(args)` directly leaves its weights uninitialized (`torch.empty`).
"""
