"""A small Kimi-Linear-style hybrid: linear-attention layers interleaved with MLA layers.

Plain PyTorch, nothing DCP-specific. The MLA layers are the very same `MLA` class as in
`dcp_pass.models.deepseek_mla` (same latent/rotary cache buffers); the linear-attention layers
keep a per-request recurrent state instead of a KV cache.

Linear attention (a gated delta rule, KDA-like, without the short convolution): per head,
with L2-normalised q, k in R^dk, v in R^dv, a per-channel decay a_t in (0, 1)^dk and a
write strength b_t in (0, 1):

    S_t = diag(a_t) S_{t-1}
    S_t = S_t + b_t * k_t^T (v_t - k_t S_t)
    o_t = (q_t / sqrt(dk)) S_t

followed by a per-head RMSNorm, a sigmoid output gate and a row-parallel output projection.
Heads are split over TP ranks like attention heads. The state lives in the buffer
`state` [max_batch, n_local_heads, dk, dv] (persistent=False); it restarts from zero when
start_pos == 0 and is written back in place, so it carries over between calls. Unlike a
KV cache it cannot be rewound: feed every position exactly once, in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dcp_pass.models.deepseek_mla import (
    Block,
    ColumnParallelLinear,
    ModelArgs,
    RMSNorm,
    RowParallelLinear,
    Transformer,
    _build,
    _divide,
)

__all__ = ["HybridArgs", "LinearAttention", "HybridTransformer", "build_hybrid"]


@dataclass
class HybridArgs(ModelArgs):
    layer_pattern: list[str] = field(default_factory=lambda: ["linear", "mla", "linear", "mla"])
    linear_n_heads: Optional[int] = None  # None: n_heads
    linear_head_dim_k: int = 16
    linear_head_dim_v: int = 16
    decay_scale: float = 0.25  # log-decay = -decay_scale * softplus(.), keeps memory long

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [k for k in self.layer_pattern if k not in ("linear", "mla")]
        if bad:
            raise ValueError(f"layer_pattern entries must be 'linear' or 'mla', got {bad}")
        self.layer_pattern = list(self.layer_pattern)
        self.n_layers = len(self.layer_pattern)
        if self.linear_n_heads is None:
            self.linear_n_heads = self.n_heads


class LinearAttention(nn.Module):
    """Gated delta-rule linear attention with a recurrent state buffer (see module doc)."""

    def __init__(self, args: HybridArgs, tp_size: int = 1, group: Any = None):
        super().__init__()
        dt = args.dtype
        self.n_heads = args.linear_n_heads
        self.n_local_heads = _divide(self.n_heads, tp_size, "linear_n_heads")
        self.dk = args.linear_head_dim_k
        self.dv = args.linear_head_dim_v
        self.decay_scale = args.decay_scale
        self.wq = ColumnParallelLinear(args.dim, self.n_heads * self.dk, tp_size, dt, group)
        self.wk = ColumnParallelLinear(args.dim, self.n_heads * self.dk, tp_size, dt, group)
        self.wv = ColumnParallelLinear(args.dim, self.n_heads * self.dv, tp_size, dt, group)
        self.w_decay = ColumnParallelLinear(args.dim, self.n_heads * self.dk, tp_size, dt, group)
        self.w_beta = ColumnParallelLinear(args.dim, self.n_heads, tp_size, dt, group)
        self.w_gate = ColumnParallelLinear(args.dim, self.n_heads * self.dv, tp_size, dt, group)
        self.o_norm = RMSNorm(self.dv, dtype=dt)
        self.wo = RowParallelLinear(self.n_heads * self.dv, args.dim, tp_size, dt, group)
        self.register_buffer(
            "state",
            torch.zeros(args.max_batch_size, self.n_local_heads, self.dk, self.dv, dtype=dt),
            persistent=False,
        )

    def forward(
        self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        # positions are implicit in the recurrence: freqs_cis and mask are unused
        bsz, seqlen, _ = x.size()
        h, dk, dv = self.n_local_heads, self.dk, self.dv
        q = F.normalize(self.wq(x).view(bsz, seqlen, h, dk).float(), dim=-1) * dk**-0.5
        k = F.normalize(self.wk(x).view(bsz, seqlen, h, dk).float(), dim=-1)
        v = self.wv(x).view(bsz, seqlen, h, dv).float()
        decay = torch.exp(-self.decay_scale * F.softplus(self.w_decay(x).view(bsz, seqlen, h, dk).float()))
        beta = torch.sigmoid(self.w_beta(x).float())  # [b, s, h]

        if start_pos == 0:
            state = torch.zeros(bsz, h, dk, dv, dtype=torch.float32, device=x.device)
        else:
            state = self.state[:bsz].float()
        outs = []
        for t in range(seqlen):
            k_t = k[:, t]  # [b, h, dk]
            state = state * decay[:, t].unsqueeze(-1)
            predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
            delta = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)
            state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        self.state[:bsz].copy_(state)

        o = torch.stack(outs, dim=1).to(x.dtype)  # [b, s, h, dv]
        o = self.o_norm(o) * torch.sigmoid(self.w_gate(x).view(bsz, seqlen, h, dv))
        return self.wo(o.flatten(2))


class HybridTransformer(Transformer):
    """Transformer whose blocks follow `args.layer_pattern` ("linear" or "mla")."""

    def _make_block(self, layer_id: int, args: HybridArgs,  # type: ignore[override]  # built from HybridArgs only
                    tp_size: int, tp_rank: int) -> nn.Module:
        kind = args.layer_pattern[layer_id]
        attn = LinearAttention(args, tp_size, args.tp_group) if kind == "linear" else None
        return Block(layer_id, args, tp_size, tp_rank, attn=attn)

    @property
    def has_recurrent_state(self) -> bool:
        return True


def build_hybrid(args: HybridArgs, rank: Optional[int] = None, seed: int = 0, device=None) -> HybridTransformer:
    """A HybridTransformer with TP rank `rank`'s shard of deterministic, TP-independent weights."""
    return _build(HybridTransformer, args, rank, seed, device)
