"""Small models, inputs and graph rendering shared by the graph tests.

`TinyMLA`: absorbed MLA reduced to its attention, short enough to pin a whole rewritten
graph. `StaticPosMLA`: the same with tensor positions and whole-cache reads (the
static-shape form). `render`: a graph's code, normalized for pinning. `init_fake_world`:
an in-process fake process group of any size. `PinCase`: the pins' TestCase (at the end).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from dcp_pass.testing.graphs import readable_code


# ----------------------------------------------------------------------------- a tiny MLA


class TinyMLA(nn.Module):
    """Absorbed MLA reduced to the attention: the caller passes absorbed queries and new KV rows.

    kv_cache [B, T, rank] (latent) and pe_cache [B, T, rope] (rotary), written by slice
    assignment; einsum scores; fp32 softmax; values are the latent rows; then the value
    half of wkv_b (`w_uv`). `fused`: one latent||rotary cache. `mask_fill`: boolean mask
    through masked_fill instead of an additive one. `leak_probs`: the probabilities are
    also returned (a near miss: they are used outside the value product).
    """

    def __init__(self, heads=4, rank=8, rope=4, v_dim=6, batch=2, max_seq=16,
                 fused=False, mask_fill=False, leak_probs=False):
        super().__init__()
        self.rank, self.fused, self.mask_fill, self.leak_probs = rank, fused, mask_fill, leak_probs
        self.w_uv = nn.Parameter(torch.randn(heads, v_dim, rank))
        if fused:
            self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank + rope))
        else:
            self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank))
            self.register_buffer("pe_cache", torch.zeros(batch, max_seq, rope))

    def forward(self, q_lat, q_pe, latent, k_pe, start_pos: int, mask: Optional[torch.Tensor] = None):
        bsz, seqlen = q_lat.shape[:2]
        end = start_pos + seqlen
        if self.fused:
            self.kv_cache[:bsz, start_pos:end] = torch.cat([latent, k_pe], dim=-1)
            cache = self.kv_cache[:bsz, :end]
            scores = torch.einsum("bshc,btc->bsht", torch.cat([q_lat, q_pe], dim=-1), cache)
            values = cache[..., : self.rank]
        else:
            self.kv_cache[:bsz, start_pos:end] = latent
            self.pe_cache[:bsz, start_pos:end] = k_pe
            scores = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz, :end]) + torch.einsum(
                "bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])
            values = self.kv_cache[:bsz, :end]
        scores = scores * 0.25
        if mask is not None:
            if self.mask_fill:
                scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
            else:
                scores = scores + mask.unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_lat)
        o = torch.einsum("bsht,btc->bshc", probs, values)
        o = torch.einsum("bshc,hdc->bshd", o, self.w_uv).flatten(2)
        return (o, probs) if self.leak_probs else o


class ValueUseMLA(nn.Module):
    """TinyMLA's decode attention (same inputs, `tiny_inputs`) with the attention output used
    in other ways than the plain value up-projection (for the project-before-merge pass).

    `use`: "leak" also returns the output before `w_uv`; "relu" projects relu(output);
    "buffer" projects by a `w_uv` held as a buffer, not a parameter; "none" returns the
    output unprojected; "bmm" projects by `torch.bmm` over flattened (batch, position) rows.
    """

    def __init__(self, use: str, heads=4, rank=8, rope=4, v_dim=6, batch=2, max_seq=16):
        super().__init__()
        self.use = use
        w_uv = torch.randn(heads, v_dim, rank)
        if use == "buffer":
            self.register_buffer("w_uv", w_uv)
        else:
            self.w_uv = nn.Parameter(w_uv)
        self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank))
        self.register_buffer("pe_cache", torch.zeros(batch, max_seq, rope))

    def forward(self, q_lat, q_pe, latent, k_pe, start_pos: int):
        bsz, seqlen = q_lat.shape[:2]
        end = start_pos + seqlen
        self.kv_cache[:bsz, start_pos:end] = latent
        self.pe_cache[:bsz, start_pos:end] = k_pe
        scores = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz, :end]) + torch.einsum(
            "bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])
        probs = (scores * 0.25).softmax(dim=-1, dtype=torch.float32).type_as(q_lat)
        o = torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, :end])
        if self.use == "none":
            return o.flatten(2)
        if self.use == "bmm":
            rows = o.flatten(0, 1).transpose(0, 1)  # [h, b*s, rank]
            return torch.bmm(rows, self.w_uv.transpose(1, 2)).transpose(0, 1).reshape(bsz, seqlen, -1)
        projected = torch.einsum("bshc,hdc->bshd", torch.relu(o) if self.use == "relu" else o, self.w_uv)
        return (projected.flatten(2), o) if self.use == "leak" else projected.flatten(2)


def causal_mask(seqlen: int, start_pos: int, kind: str = "additive") -> torch.Tensor:
    """Query i (global position start_pos + i) sees keys <= start_pos + i."""
    if kind == "additive":
        return torch.full((seqlen, start_pos + seqlen), float("-inf")).triu_(start_pos + 1)
    return torch.ones((seqlen, start_pos + seqlen), dtype=torch.bool).triu_(start_pos + 1)


def tiny_inputs(seqlen: int, start_pos: int, mask: Optional[str] = None, heads=4, rank=8, rope=4, batch=2):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(batch, seqlen, heads, rank, generator=g), torch.randn(batch, seqlen, heads, rope, generator=g),
            torch.randn(batch, seqlen, rank, generator=g), torch.randn(batch, seqlen, rope, generator=g), start_pos)
    return args + ((causal_mask(seqlen, start_pos, mask),) if mask else ())


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


# ----------------------------------------------------------------------------- rendering


def render(gm: fx.GraphModule) -> str:
    """The whole graph as normalized Python code (the public helper users pin with)."""
    return readable_code(gm)


# ----------------------------------------------------------------------------- a fake world


def init_fake_world(c: int) -> None:
    """A fake process group of `c` ranks; this process is rank 0."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=c)


# ----------------------------------------------------------------------------- static positions


class StaticPosMLA(nn.Module):
    """Absorbed MLA attention with tensor positions, whole-cache reads and a boolean mask."""

    def __init__(self, heads=4, rank=8, rope=4, v_dim=6, batch=2, max_seq=16):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w_uv = nn.Parameter(torch.randn(heads, v_dim, rank, generator=g))
        self.register_buffer("kv_cache", torch.zeros(batch, max_seq, rank))
        self.register_buffer("pe_cache", torch.zeros(batch, max_seq, rope))

    def forward(self, q_lat, q_pe, latent, k_pe, input_pos):
        bsz = q_lat.shape[0]
        self.kv_cache[:bsz, input_pos] = latent
        self.pe_cache[:bsz, input_pos] = k_pe
        keys = torch.arange(self.kv_cache.shape[1], device=input_pos.device)
        future = keys[None, :] > input_pos[:, None]  # [s, T]: keys after each query
        scores = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz]) + torch.einsum(
            "bshr,btr->bsht", q_pe, self.pe_cache[:bsz])
        scores = (scores * 0.25).masked_fill(future.unsqueeze(1), float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_lat)
        o = torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz])
        return torch.einsum("bshc,hdc->bshd", o, self.w_uv).flatten(2)


def _inputs(step_positions, g, heads=4, rank=8, rope=4, batch=2):
    s = len(step_positions)
    return (torch.randn(batch, s, heads, rank, generator=g), torch.randn(batch, s, heads, rope, generator=g),
            torch.randn(batch, s, rank, generator=g), torch.randn(batch, s, rope, generator=g),
            torch.tensor(step_positions))


# ----------------------------------------------------------------------------- matcher captures


def matches_of(model: nn.Module, calls) -> list:
    """`find_mla` (a GraphMatches) of each graph Dynamo captures over the calls `model(*args)`,
    `args` in `calls`: no rewrite, no process group.

    The matcher runs inside the recording backend, as in the pass: Dynamo drops the
    placeholders' `grapharg` (where buffer sources come from) once the backend returns.
    """
    from dcp_pass.rewrites.match import find_mla

    from dcp_pass.testing.graphs import run_compiled

    graphs: list = []

    def record(gm, example_inputs):
        graphs.append(find_mla(gm.graph))
        return gm.forward

    run_compiled(model, record, calls)
    return graphs


# ----------------------------------------------------------------------------- the pins' TestCase
# (last in this file: the pins quote line numbers of the models above)
try:
    import expecttest

    PinCase = expecttest.TestCase
except ImportError:  # a machine without the test extras (the GPU machine): a file's other tests still run
    import unittest

    @unittest.skip("the graph pins need expecttest (pip install -e '.[test]')")
    class PinCase(unittest.TestCase):
        """Stands in for expecttest.TestCase where it is not installed: the pins skip."""
