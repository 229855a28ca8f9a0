"""A layer the pass keeps keeps its own cache, also when every layer's cache has one shape.

A decoder written as models here are (one `Block` class, every block owning a latent cache
`kv_cache [max_batch, max_seq, rank + rope]` of the same shape), with gpt-oss's / Gemma's
layer pattern: blocks alternate a sliding window and full attention. A full block writes
its latent rows at their positions and attends over `kv_cache[:b, :end]` (absorbed MLA): the
pass stripes it. A sliding block keeps the last WINDOW positions in the first WINDOW rows of
the same-shape buffer, shifted with `torch.roll` as tokens arrive (a rolling cache, as
Hugging Face's sliding layers keep theirs), and attends over those rows: they are not token
positions, so the pass keeps that layer as it is, its cache whole on every rank. Striping
the full blocks' caches must leave the sliding blocks' caches alone: they are the same
attribute of the same class, with the same shape.

Two ways to compile it: the whole model as one graph, and one graph per block (a graph break
between blocks, the way a model with a data-dependent MoE loop compiles), where the full
blocks share one graph and the sliding blocks another. Greedy fp32 tokens equal the eager
model's over 10 decode steps, for requests of ragged prompt lengths (the window shifts), and
the report says per layer which were striped and which kept and why. With a graph per
block, the blocks' graphs compile once per kind of block, wherever the block keeps its
window. A block told its window by its caller cannot be told apart by Dynamo's guards on
the block: that is refused with what to change.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from dcp_pass import env
from dcp_pass.testing import run_ranks

VOCAB, DIM, HEADS, NOPE, ROPE, RANK, V = 48, 32, 4, 8, 4, 8, 8
MAX_B, MAX_S, WINDOW, LAYERS = 2, 24, 5, 4
PROMPTS = [5, 3, 4]  # a length per request; none longer than the window (a prefill fits its rows)
DECODE = 10


class Block(nn.Module):
    """Absorbed MLA over a fused latent||rotary cache. `window`: None for full attention, or the
    size of a sliding window kept in the first `window` rows of the cache, the newest last."""

    def __init__(self, layer_id: int, window: Optional[int]):
        super().__init__()
        g = torch.Generator().manual_seed(100 + layer_id)
        self.layer_id, self.window = layer_id, window
        self.wq = nn.Parameter(torch.randn(HEADS * (NOPE + ROPE), DIM, generator=g) / DIM**0.5)
        self.wkv_a = nn.Parameter(torch.randn(RANK + ROPE, DIM, generator=g) / DIM**0.5)
        self.wkv_b = nn.Parameter(torch.randn(HEADS * (NOPE + V), RANK, generator=g) / RANK**0.5)
        self.wo = nn.Parameter(torch.randn(DIM, HEADS * V, generator=g) / (HEADS * V) ** 0.5)
        self.register_buffer("kv_cache", torch.zeros(MAX_B, MAX_S, RANK + ROPE), persistent=False)
        self.scale = (NOPE + ROPE) ** -0.5

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        return self.attend(x, start_pos, self.window)

    def attend(self, x: torch.Tensor, start_pos: int, window: Optional[int]) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = (x @ self.wq.T).view(bsz, seqlen, HEADS, NOPE + ROPE)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        wkv_b = self.wkv_b.view(HEADS, NOPE + V, RANK)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :NOPE])
        rows = x @ self.wkv_a.T  # latent || rotary of the new tokens
        query_pos = torch.arange(start_pos, end, device=x.device)
        if window is None:
            self.kv_cache[:bsz, start_pos:end] = rows
            keys = self.kv_cache[:bsz, :end]
            key_pos = torch.arange(end, device=x.device)
            visible = key_pos[None, :] <= query_pos[:, None]
        else:
            w = window
            # a shift register: the last w positions in rows 0..w-1, the newest last
            self.kv_cache[:bsz, :w] = torch.roll(self.kv_cache[:bsz, :w], -seqlen, dims=1)
            self.kv_cache[:bsz, w - seqlen:w] = rows
            keys = self.kv_cache[:bsz, :w]
            key_pos = torch.arange(end - w, end, device=x.device)  # negative: no position yet
            visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos[:, None]) & (
                query_pos[:, None] - key_pos[None, :] < w)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        scores = torch.einsum("bshc,btc->bsht", torch.cat([q_lat, q_pe], dim=-1), keys) * self.scale
        probs = (scores + mask[:, None, :]).softmax(dim=-1, dtype=torch.float32)
        o = torch.einsum("bsht,btc->bshc", probs, keys[..., :RANK])
        o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, NOPE:])
        return x + o.flatten(2) @ self.wo.T


class Decoder(nn.Module):
    """Blocks alternating a sliding window (even layers) and full attention (odd layers), as
    gpt-oss and Gemma lay theirs out. `graph_break`: a graph break between blocks, so that each
    block's call is a graph of its own (the full blocks share one, the sliding blocks another)."""

    def __init__(self, graph_break: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = nn.Parameter(torch.randn(VOCAB, DIM, generator=g))
        self.layers = nn.ModuleList(Block(i, WINDOW if i % 2 == 0 else None) for i in range(LAYERS))
        self.head = nn.Parameter(torch.randn(VOCAB, DIM, generator=g) / DIM**0.5)
        self.graph_break = graph_break

    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        h = self.embed[tokens]
        for layer in self.layers:
            if self.graph_break:
                torch._dynamo.graph_break()
            h = layer(h, start_pos)
        return h[:, -1] @ self.head.T


def _greedy(model, prompt: torch.Tensor, steps: int):
    """Greedy tokens and the logits of each step, for one request from position 0."""
    logits = [model(prompt, 0)]
    tokens = [logits[-1].argmax(-1)]
    for step in range(steps):
        logits.append(model(tokens[-1][:, None], prompt.shape[1] + step))
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def _run(rank: int, world: int, graph_break: bool, inner: str):
    from dcp_pass.backend import DcpBackend
    from dcp_pass.state.guards import StripedCacheTensor

    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(VOCAB, (MAX_B, n), generator=g) for n in PROMPTS]
    eager = Decoder(graph_break)
    model = Decoder(graph_break)
    backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
    compiled = torch.compile(model, backend=backend)
    tokens_equal, worst = [], 0.0
    for prompt in prompts:
        want_tokens, want = _greedy(eager, prompt, DECODE)
        got_tokens, got = _greedy(compiled, prompt, DECODE)
        tokens_equal.append(torch.equal(got_tokens, want_tokens))
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    layers = {}
    for graph in backend.report.graphs:
        for layer in graph.layers:
            layers.setdefault(layer.layer, set()).add((layer.rewritten, layer.detail))
    striped = [type(block.kv_cache) is StripedCacheTensor for block in model.layers]
    own_bytes = [block.kv_cache.untyped_storage().nbytes() for block in model.layers]
    return dict(tokens_equal=tokens_equal, worst=worst, striped=striped, own_bytes=own_bytes, layers=layers,
                graphs=len(backend.graphs))


def _check(result, graph_break: bool):
    assert all(result["tokens_equal"]), result
    assert result["worst"] < 1e-5, result
    # the full blocks' caches striped, the sliding blocks' whole (their own storage)
    assert result["striped"] == [i % 2 == 1 for i in range(LAYERS)], result
    assert result["own_bytes"] == [0 if i % 2 else MAX_B * MAX_S * (RANK + ROPE) * 4 for i in range(LAYERS)], result
    # prefill and decode (its first step, then the symbolic position): a graph each; with a
    # graph break, one for the full blocks and one for the sliding blocks of each (a full
    # block's graph compiles once for both full blocks)
    assert result["graphs"] == (6 if graph_break else 3), result
    kept = "left as it is: a rolling (sliding-window) cache"
    if graph_break:  # a graph per kind of block: its report line names the block's own cache
        assert {rewritten for rewritten, _ in result["layers"]["kv_cache"]} == {True, False}, result
        assert any(kept in detail for _, detail in result["layers"]["kv_cache"]), result
        return
    assert sorted(result["layers"]) == [f"layers.{i}" for i in range(LAYERS)], result
    for i in range(LAYERS):
        for rewritten, detail in result["layers"][f"layers.{i}"]:
            assert rewritten == (i % 2 == 1), (i, detail)
            assert (kept in detail and f"layers.{i}.kv_cache" in detail) if i % 2 == 0 else "softmax form" in detail


# CI: c = 2 as one graph (a graph per block is checked in one process below); DCP_TEST_FULL=1
# adds a graph per block at c = 2 and both at c = 4 under aot_eager
CASES = [(2, False, "eager")] + ([(2, True, "eager"), (4, False, "aot_eager"), (4, True, "aot_eager")]
                                  if env.full_tests() else [])


@pytest.mark.slow
@pytest.mark.parametrize("world,graph_break,inner", CASES)
def test_kept_layers_keep_their_caches(world, graph_break, inner):
    for result in run_ranks(_run, world, graph_break, inner):
        _check(result, graph_break)


class OuterBlock(nn.Module):
    """A block whose cache lives in its attention submodule (a `Block`); its window is an
    attribute of that submodule (`on_outer` False) or of the block itself (True)."""

    def __init__(self, layer_id: int, window: Optional[int], on_outer: bool):
        super().__init__()
        self.attn = Block(layer_id, None if on_outer else window)
        self.on_outer, self.window = on_outer, window

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        return self.attn.attend(x, start_pos, self.window) if self.on_outer else self.attn(x, start_pos)


@pytest.mark.parametrize("on_outer", [False, True], ids=["window_on_attention", "window_on_block"])
@torch.no_grad()
def test_a_graph_per_block_compiles_once_per_kind_of_block(fake_world, on_outer):
    """Six blocks, a graph break between them: a prefill and a decode graph for the full
    blocks and for the sliding ones, however many blocks there are (the full blocks' caches
    striped together at the first full block's compile), the sliding blocks' caches whole."""
    from dcp_pass.backend import DcpBackend
    from dcp_pass.state.guards import StripedCacheTensor

    model = Decoder(graph_break=True)
    model.layers = nn.ModuleList(OuterBlock(i, WINDOW if i % 2 == 0 else None, on_outer) for i in range(6))
    backend = DcpBackend(dcp_size=2, tp_size=1, inner="eager")
    _greedy(torch.compile(model, backend=backend), torch.zeros(MAX_B, 4, dtype=torch.long), 3)
    assert [type(block.attn.kv_cache) is StripedCacheTensor for block in model.layers] == [False, True] * 3
    assert len(backend.graphs) == 4


class ArgumentBlock(Block):
    """A block told its window by its caller: Dynamo's guards on the block cannot tell a
    sliding block from a full one."""

    def forward(self, x: torch.Tensor, start_pos: int, window: Optional[int]) -> torch.Tensor:
        return self.attend(x, start_pos, window)


class ArgumentDecoder(Decoder):
    def __init__(self):
        super().__init__(graph_break=True)
        self.layers = nn.ModuleList(ArgumentBlock(i, None) for i in range(LAYERS))
        self.windows = [WINDOW if i % 2 == 0 else None for i in range(LAYERS)]

    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        h = self.embed[tokens]
        for layer, window in zip(self.layers, self.windows):
            torch._dynamo.graph_break()
            h = layer(h, start_pos, window)
        return h[:, -1] @ self.head.T


@torch.no_grad()
def test_a_window_passed_as_an_argument_is_refused_with_what_to_change(fake_world):
    """The one case the guards cannot foresee: the full block's graph stripes a sliding block's
    cache with its own, and the sliding block's graph then refuses it, saying why and what to
    change (before: the same refusal, without the why)."""
    from dcp_pass.backend import DcpBackend
    from dcp_pass.rewrites.apply import DcpRewriteError

    torch._dynamo.reset()
    compiled = torch.compile(ArgumentDecoder(), backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    with pytest.raises(Exception, match=r"layers\.2\.kv_cache was striped with layers\.1\.kv_cache.*"
                                        r"keep that value as an attribute of the block") as raised:
        _greedy(compiled, torch.zeros(MAX_B, 3, dtype=torch.long), 2)  # Dynamo wraps the backend's error
    chain = [raised.value, raised.value.__cause__, getattr(raised.value, "inner_exception", None)]
    assert any(isinstance(e, DcpRewriteError) for e in chain), [type(e) for e in chain]
