"""Graph-diff regression tests: what the DCP pass does to captured graphs.

Each test compiles a model with `DcpBackend(inner="eager")` on an in-process fake
process group (`backend="fake"`: any world size, right shapes, garbage data), takes
the FX graph the backend handed to its inner compiler and pins readable code of it
with `assertExpectedInline`. Any change to the rewrite shows up as a diff here.

Regenerate after an intended change with
    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_graph_diff.py
and review the diff by eye.

Most cases use `TinyMLA` (tests/kit/graphs.py), whose whole rewritten graph is short enough to
pin. Cases that need the example models (fused cache, masked_fill, hybrid,
q-replication) pin only the attention region: from the first striped cache write
(`striped_write = ...write_owned_tokens_(...)`) to the node that consumes the merged output.

Code is normalized before pinning (`dcp_pass.testing.readable_code`): Dynamo's `l_self_modules_..._`
names are shortened (`l_self_modules_attn_buffers_kv_cache_` -> `attn_kv_cache`),
`x = L_x_` alias lines and fx's `;  a = b = None` liveness suffixes are dropped,
and the signature lists bare input names.
"""
from __future__ import annotations

import operator
import re
import unittest

from kit.graphs import PinCase

from dcp_pass.runtime.decode.layout import write_owned_tokens_, write_tokens_at_
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from dcp_pass.backend import DcpBackend
from dcp_pass.runtime.decode import comm
from kit.graphs import TinyMLA, TinyMLP, ValueUseMLA, init_fake_world, render, tiny_inputs

EXCHANGES = (comm.exchange_a2a, comm.exchange_ag_rs, comm.exchange_replicated, comm.exchange_fi_a2a)


# ----------------------------------------------------------------------------- rendering


def _exchange_node(gm: fx.GraphModule) -> fx.Node:
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in EXCHANGES]
    assert len(found) == 1, f"expected one exchange node, found {len(found)}"
    return found[0]


def region(gm: fx.GraphModule) -> str:
    """Normalized code from the first striped write to the first consumer of the merged output."""
    lines = render(gm).splitlines()
    first = next(i for i, l in enumerate(lines) if l.strip().startswith("striped_write"))
    consumers = {u.name for u in _exchange_node(gm).users}
    last = next(i for i, l in enumerate(lines) if l.strip().split(" = ")[0] in consumers)
    return "\n".join(l.strip() for l in lines[first:last + 1])


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return "." + node.target
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if target is operator.getitem:
        return "[]"
    if target is operator.setitem:
        return "[]="
    return getattr(target, "__name__", str(target))


def op_summary(gm: fx.GraphModule, attention_only: bool = True) -> str:
    """The call targets in order, one line; `attention_only`: first striped write .. exchange consumer."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    if attention_only:
        start = next(i for i, n in enumerate(nodes) if n.name.startswith("striped_write"))
        users = _exchange_node(gm).users
        stop = next(i for i, n in enumerate(nodes) if n in users)
        nodes = nodes[start:stop + 1]
    return " ".join(_op_name(n) for n in nodes)


def cache_placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and re.search(r"buffers_\w*cache", n.name)]


# ----------------------------------------------------------------------------- test case


def _replicated_region_on_gloo(rank: int, world: int) -> str:
    """Rank 0's attention region of a bf16 TP=2 model compiled with replicate_q_proj=True.

    Needs real ranks: replication gathers the q weights at compile time and keeps the
    ones that differ across ranks (the fake process group returns identical copies).
    complex_as_real=True (on by default with inductor only) pins the replicated query's
    rotary in real arithmetic.
    """
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    model = build_model(ModelArgs(tp_size=world, n_layers=1, n_dense_layers=1, dtype=torch.bfloat16), rank=rank)
    be = DcpBackend(dcp_size=world, inner="eager", comm_backend="a2a", replicate_q_proj=True, complex_as_real=True)
    with torch.no_grad():
        torch.compile(model, backend=be)(torch.zeros(2, 1, dtype=torch.long), 4)
    return region(be.graphs[0]) + "\n---\n" + be.report.summary()


class GraphDiffTest(PinCase):
    def setUp(self):
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()

    # helpers

    def world(self, c: int) -> None:
        init_fake_world(c)

    def dcp(self, model: nn.Module, *calls: tuple, c: int, **options) -> DcpBackend:
        """Compile `model` with a DCP backend on a fake world of `c` ranks and run each call."""
        if not dist.is_initialized() or dist.get_world_size() != c:
            self.world(c)
        options.setdefault("inner", "eager")
        be = DcpBackend(dcp_size=c, **options)
        compiled = torch.compile(model, backend=be)
        with torch.no_grad():
            for args in calls:
                compiled(*args)
        return be

    def plain(self, model: nn.Module, *calls: tuple) -> list[fx.GraphModule]:
        """The graphs Dynamo captures without DCP."""
        torch._dynamo.reset()
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(model, backend=record)
        with torch.no_grad():
            for args in calls:
                compiled(*args)
        torch._dynamo.reset()
        return graphs

    def assertRewritten(self, gm: fx.GraphModule, layers: int = 1) -> None:
        """Striped writes replaced every cache write and nothing reads a full cache buffer."""
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets.count(torch.ops.dcp.mla_local_attention.default), layers)
        self.assertNotIn(operator.setitem, targets)  # no slice assignment into a full cache is left
        shard_writes = [n for n in gm.graph.nodes
                        if n.op == "call_function" and n.target in (write_owned_tokens_, write_tokens_at_)]
        self.assertGreaterEqual(len(shard_writes), layers)
        for node in shard_writes:  # into a shard, never into a full-size buffer
            self.assertTrue(node.args[0].name.startswith("dcp_local_cache"), node.format_node())
        caches = cache_placeholders(gm)
        self.assertTrue(caches)
        for node in caches:
            self.assertEqual(list(node.users), [], f"{node.name} (full-size cache) is still read")

    # ------------------------------------------------------------------ TinyMLA: the three phases

    def test_decode(self):
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="a2a")
        self.assertEqual(len(be.graphs), 1)
        self.assertRewritten(be.graphs[0])
        # end = 6 positions: rank 0 of 2 owns 0, 2, 4 -> local slice [:2, :3]; no mask for one token
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")
        self.assertExpectedInline(be.report.summary(), """\
dcp_pass report: dcp_size=2 rank=0, 1 graph(s)
  graph 0: 1 MLA layer(s) rewritten
    rewrote kv_cache: decode, softmax form, 2 score term(s), q all-gather (queries use no weights), comm a2a, lse base e, attention auto, v-projection before merge (exchanges 6 instead of 8 columns per head); kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw, gluon_roles, gluon_lock_step, gluon_fp8, gluon_fp8_narrow, wide, split, per_head, flashinfer: needs CUDA tensors, the call's are on cpu)
  KV cache bytes on this rank: 1536 without DCP -> 864 with DCP (1.78x less)
  striped cache bytes per token per layer: 48 without DCP -> 27 on this rank
  striped, not to be read outside compiled graphs: kv_cache, pe_cache""")

    def test_decode_symbolic_start_pos(self):
        # a second start_pos makes it a SymInt: the local key count becomes graph arithmetic
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), tiny_inputs(1, 6), c=2, comm_backend="a2a")
        self.assertEqual(len(be.graphs), 2)
        self.assertRewritten(be.graphs[1])
        self.assertExpectedInline(render(be.graphs[1]), """\
def forward(self, q_lat, start_pos, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    add = start_pos + 1
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, start_pos, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, start_pos, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_prefill(self):
        be = self.dcp(TinyMLA(), tiny_inputs(4, 0, "additive"), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        # the [S, T] causal mask is put in [B, S, H, T] order and striped like the keys (columns 0::2)
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, mask, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 0, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 0, 2, 0, 16, 0)
    unsqueeze = mask.unsqueeze(1)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    getitem_2 = unsqueeze[(None, Ellipsis)]
    mask_f32 = getitem_2.float()
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 4, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = mask_f32, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_verify(self):
        # static multi-token verification: s = k + 1 = 3 tokens at start_pos 5 with a causal mask
        be = self.dcp(TinyMLA(), tiny_inputs(3, 5, "additive"), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, mask, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    unsqueeze = mask.unsqueeze(1)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    getitem_2 = unsqueeze[(None, Ellipsis)]
    mask_f32 = getitem_2.float()
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 8, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = mask_f32, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")
        self.assertIn("multi-token", be.report.summary())

    # ------------------------------------------------------------------ comm backends and modes

    def test_head_sharded_a2a(self):
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="a2a")
        self.assertExpectedInline(op_summary(be.graphs[0]), """write_owned_tokens_ write_owned_tokens_ [] [] cat gather_heads [] [] dcp.mla_local_attention [] [] .chunk [] einsum [] einsum cat exchange_a2a .flatten""")

    def test_head_sharded_ag_rs(self):
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="ag_rs")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_ag_rs(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_head_replicated_a2a(self):
        # tp_size=1: every rank holds all heads; no query gather, all heads come back from the merge
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, tp_size=1, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat, q_pe, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, w_uv)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_head_replicated_ag_rs(self):
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, tp_size=1, comm_backend="ag_rs")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat, q_pe, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, w_uv)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'ag_rs', base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    # ------------------------------------------------------------------ DCP sizes

    def _decode_c(self, c: int, **options) -> fx.GraphModule:
        be = self.dcp(TinyMLA(max_seq=32), tiny_inputs(1, 13), c=c, comm_backend="a2a", **options)
        self.assertRewritten(be.graphs[0])
        return be.graphs[0]

    def test_dcp_size_2(self):
        # end = 14: rank 0 owns 0, 2, ..., 12 -> 7 local keys
        self.assertExpectedInline(render(self._decode_c(2)), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 13, 2, 0, 32, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 13, 2, 0, 32, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 14, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_dcp_sizes_differ_only_in_constants(self):
        # c = 4 and 8 are pinned through c = 2 (test_dcp_size_2): the same code, with the DCP
        # size the only constant that changes (batch 2, start 13, capacity 32 stay). The
        # projection before the merge takes one weight per DCP rank (below), so the
        # comparison runs without it
        number = re.compile(r"\b\d+\b")
        pinned = render(self._decode_c(2, project_before_merge=False))
        torch._dynamo.reset()
        for c in (4, 8):
            with self.subTest(c=c):
                code = render(self._decode_c(c, project_before_merge=False))
                torch._dynamo.reset()
                self.assertEqual(number.sub("N", code), number.sub("N", pinned))
                changed = {(a, b) for a, b in zip(number.findall(pinned), number.findall(code)) if a != b}
                self.assertEqual(changed, {("2", str(c))})
                self.assertEqual(code.count(f"c = {c}, rank = 0"), 1)
                # with it: head chunk r projected by rank r's weight, this rank's own for chunk 0
                projected = render(self._decode_c(c))
                torch._dynamo.reset()
                self.assertEqual(projected.count("partial_proj_"), 2 * c)  # defined, then concatenated
                self.assertIn(f"partial_heads = partial_out.chunk({c}, 2)", projected)
                self.assertIn("partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)",
                              projected)
                for r in range(1, c):
                    self.assertIn(f"partial_heads_{r}, dcp_vc_weight_{r - 1})", projected)

    # ------------------------------------------------------------------ project before merge

    def test_project_before_merge_off(self):
        # off: the graph the attention pass leaves, the exchange carrying the 8 latent columns
        be = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="a2a", project_before_merge=False)
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    merged = dcp_pass_runtime_decode_comm_exchange_a2a(partial_out, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    einsum_3 = torch.functional.einsum('bshc,hdc->bshd', merged, w_uv)
    o_1 = einsum_3.flatten(2)
    return (o_1,)""")
        self.assertExpectedInline("\n".join(be.report.graphs[0].detail_lines()), """\
rewrote kv_cache: decode, softmax form, 2 score term(s), q all-gather (queries use no weights), comm a2a, lse base e, attention auto
passes: allocated_caches 0, match 1, striped_writes 2, query_replication 0, attention 1, project_before_merge 0, verify_buffers 2, complex_as_real 0, install_shards 2, device_positions 0""")

    def test_project_before_merge_head_replicated_prefill(self):
        # tp_size=1, 4 tokens: one einsum over every head, the all-gather of 6 columns per head
        be = self.dcp(TinyMLA(), tiny_inputs(4, 0, "additive"), c=2, tp_size=1, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(op_summary(be.graphs[0]), """write_owned_tokens_ write_owned_tokens_ .unsqueeze [] [] [] .float dcp.mla_local_attention [] [] einsum exchange_replicated .flatten""")

    def test_project_before_merge_bmm_rows(self):
        # torch.bmm over flattened (batch, position) rows: the merged projection is laid out
        # [heads, rows, v] again for the model's own transpose and reshape
        be = self.dcp(ValueUseMLA("bmm"), tiny_inputs(1, 5), c=2, comm_backend="ag_rs")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 5, 2, 0, 16, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 5, 2, 0, 16, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
transpose_1 = w_uv.transpose(1, 2)
transpose_3 = dcp_vc_weight_0.transpose(1, 2)
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hfv->bshv', partial_heads_0, transpose_1)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hfv->bshv', partial_heads_1, transpose_3)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_ag_rs(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
permute = merged_proj.permute(2, 0, 1, 3)""")

    def test_project_before_merge_sdpa_form(self):
        # SDPA's [b, h, s, r] output, transposed back by the model: the layout ops go with the merge
        from dcp_pass.models.mla_forms import FormArgs, build_forms_model

        model = build_forms_model(FormArgs(form="sdpa", n_layers=1))
        be = self.dcp(model, (self._tokens(1), 4), c=2, tp_size=1, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, 4, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, 4, 2, 0, 48, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_14 = wkv_b[(slice(None, None, None), slice(-8, None, None))]
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_14)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)""")

    def test_project_before_merge_kept_with_reason(self):
        # where the move is not exact the projection stays after the merge and the report says why
        details = []
        for use in ("leak", "relu", "buffer", "none"):
            torch._dynamo.reset()
            be = self.dcp(ValueUseMLA(use), tiny_inputs(1, 5), c=2, comm_backend="a2a")
            self.assertRewritten(be.graphs[0])
            self.assertIs(_exchange_node(be.graphs[0]).args[0].name, "partial_out")  # the latent columns
            detail = be.report.graphs[0].layers[0].detail
            details.append(f"{use}: {detail[detail.index('v-projection'):]}")
        self.assertExpectedInline("\n".join(details), """\
leak: v-projection after merge (the merged output has another use (einsum, the graph's output))
relu: v-projection after merge (the merged output's use (relu) is not a per-head linear projection)
buffer: v-projection after merge (the projection weight is computed from w_uv, not only from module parameters)
none: v-projection after merge (the merged output leaves the graph unprojected)""")

    def test_project_before_merge_required(self):
        # True: a layer where it cannot apply is an error naming the layer
        with self.assertRaises(Exception) as raised:
            self.dcp(ValueUseMLA("leak"), tiny_inputs(1, 5), c=2, comm_backend="a2a", project_before_merge=True)
        message = str(raised.exception)
        self.assertIn("DcpRewriteError", type(raised.exception).__name__ + message)
        self.assertExpectedInline(message[message.index("layer "):].splitlines()[0], """layer kv_cache: project_before_merge=True, but the merged output has another use (einsum, the graph's output); pass project_before_merge='auto' to keep the projection after the merge where it cannot move""")
        # and where it can, True rewrites as "auto" does
        torch._dynamo.reset()
        required = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="a2a", project_before_merge=True)
        torch._dynamo.reset()
        automatic = self.dcp(TinyMLA(), tiny_inputs(1, 5), c=2, comm_backend="a2a")
        self.assertEqual(render(required.graphs[0]), render(automatic.graphs[0]))

    # ------------------------------------------------------------------ pass-through

    def test_dcp_size_1_is_unchanged(self):
        calls = [tiny_inputs(1, 5)]
        expected = self.plain(TinyMLA(), *calls)[0].code
        be = DcpBackend(dcp_size=1, inner="eager")
        with torch.no_grad():
            torch.compile(TinyMLA(), backend=be)(*calls[0])
        self.assertEqual(be.graphs[0].code, expected)
        self.assertIn("unchanged: dcp_size=1", be.report.summary())

    def test_no_mla_passes_through(self):
        x = (torch.randn(3, 8),)
        expected = self.plain(TinyMLP(), x)[0].code
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no attention at all: nothing to warn about
            be = self.dcp(TinyMLP(), x, c=2, comm_backend="a2a")
        self.assertEqual(be.graphs[0].code, expected)
        self.assertExpectedInline(be.report.summary(), """\
dcp_pass report: dcp_size=2 rank=0, 1 graph(s)
  graph 0: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)""")

    def test_near_miss_reported_and_unchanged(self):
        # the probabilities are also returned to the caller: not only used by the value product
        calls = [tiny_inputs(1, 5)]
        expected = self.plain(TinyMLA(leak_probs=True), *calls)[0].code
        # nothing rewritten because of a near miss: rank 0 warns (once) with the reason
        with self.assertWarnsRegex(UserWarning, "graph 0 was left unchanged and no graph has been rewritten so far: "
                                                "the attention at graphs.py:66 .* cannot be rewritten: attention "
                                                "probabilities are used outside the value product"):
            be = self.dcp(TinyMLA(leak_probs=True), *calls, c=2, comm_backend="a2a")
        self.assertEqual(be.graphs[0].code, expected)
        self.assertExpectedInline(be.report.summary(), """\
dcp_pass report: dcp_size=2 rank=0, 1 graph(s)
  graph 0: 0 MLA layer(s) rewritten (unchanged: no attention in this graph that the pass can rewrite (1 near miss(es)))
    near miss at graphs.py:66 `probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_lat)`: attention probabilities are used outside the value product""")

    # ------------------------------------------------------------------ spelling variants

    def test_tiny_fused_cache(self):
        be = self.dcp(TinyMLA(fused=True), tiny_inputs(1, 5), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, latent, k_pe, kv_cache, q_pe, w_uv, dcp_local_cache_0, dcp_vc_weight_0):
    cat = torch.cat([latent, k_pe], dim = -1)
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, cat, 5, 2, 0, 16, 0)
    cat_1 = torch.cat([q_lat, q_pe], dim = -1)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    q_group = dcp_pass_runtime_decode_comm_gather_heads(cat_1, '0', 2)
    local_attention = torch.ops.dcp.mla_local_attention.default(q_group, None, kv_local, None, kv_len = 6, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    def test_tiny_masked_fill(self):
        be = self.dcp(TinyMLA(mask_fill=True), tiny_inputs(4, 0, "bool"), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(render(be.graphs[0]), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, mask, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0):
    striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent, 0, 2, 0, 16, 0)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe, 0, 2, 0, 16, 0)
    unsqueeze = mask.unsqueeze(1)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    where = torch.where(unsqueeze, -inf, 0.0)
    getitem_2 = where[(None, Ellipsis)]
    mask_f32 = getitem_2.float()
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 4, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = mask_f32, lse_base = 'e', backend = 'auto')
    partial_out = local_attention[0]
    partial_lse = local_attention[1]
    partial_heads = partial_out.chunk(2, 2)
    partial_heads_0 = partial_heads[0]
    partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
    partial_heads_1 = partial_heads[1]
    partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
    partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
    merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
    o_1 = merged_proj.flatten(2)
    return (o_1,)""")

    # ------------------------------------------------------------------ example models

    def _model(self, c: int, **kw):
        from dcp_pass.models.deepseek_mla import ModelArgs, build_model

        self.world(c)
        kw.setdefault("n_layers", 1)
        kw.setdefault("n_dense_layers", kw["n_layers"])
        return build_model(ModelArgs(tp_size=c, **kw), rank=0)

    @staticmethod
    def _tokens(seqlen: int) -> torch.Tensor:
        return torch.zeros(2, seqlen, dtype=torch.long)

    def test_model_decode(self):
        # the default model (MoE blocks break it into several graphs); attention stays in one graph
        model = self._model(2, n_layers=2, n_dense_layers=1)
        be = self.dcp(model, (self._tokens(1), 4), c=2, comm_backend="a2a")
        rewritten = [g for g in be.graphs if "mla_local_attention" in g.code]
        self.assertEqual(len(rewritten), 2)
        for gm in rewritten:
            self.assertRewritten(gm)
        self.assertExpectedInline(region(rewritten[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_8 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_9 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_8)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_9)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
o_2 = merged_proj.flatten(2)""")
        self.assertExpectedInline(op_summary(rewritten[0]), """write_owned_tokens_ .squeeze write_owned_tokens_ [] [] cat gather_heads [] [] dcp.mla_local_attention [] [] [] .view [] .chunk [] einsum [] einsum cat exchange_a2a .flatten""")
        self.assertExpectedInline(be.report.summary(), """\
dcp_pass report: dcp_size=2 rank=0, 10 graph(s)
  graph 0: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 1: 1 MLA layer(s) rewritten
    rewrote attn: decode, softmax form, 2 score term(s), q all-gather (q weights are float32; replication takes unquantized bf16/fp16 only), comm a2a, lse base e, attention auto, v-projection before merge (exchanges 16 instead of 32 columns per head); kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw, gluon_roles, gluon_lock_step, gluon_fp8, gluon_fp8_narrow, wide, split, per_head, flashinfer: needs CUDA tensors, the call's are on cpu)
  graph 2: 1 MLA layer(s) rewritten
    rewrote attn: decode, softmax form, 2 score term(s), q all-gather (q weights are float32; replication takes unquantized bf16/fp16 only), comm a2a, lse base e, attention auto, v-projection before merge (exchanges 16 instead of 32 columns per head); kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw, gluon_roles, gluon_lock_step, gluon_fp8, gluon_fp8_narrow, wide, split, per_head, flashinfer: needs CUDA tensors, the call's are on cpu)
  graph 3: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 4: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 5: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 6: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 7: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 8: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  graph 9: 0 MLA layer(s) rewritten (unchanged: no absorbed-MLA attention in this graph)
  KV cache bytes on this rank: 122880 without DCP -> 62720 with DCP (1.96x less)
  striped cache bytes per token per layer: 160 without DCP -> 81.67 on this rank
  striped, not to be read outside compiled graphs: attn.kv_cache, attn.pe_cache, layers.1.attn.kv_cache, layers.1.attn.pe_cache""")

    def test_model_fused_cache(self):
        model = self._model(2, fused_cache=True)
        be = self.dcp(model, (self._tokens(1), 4), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, cat, 4, 2, 0, 96, 0)
q_full = torch.cat([q_lat, q_pe_1], dim = -1)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_full, '0', 2)
local_attention = torch.ops.dcp.mla_local_attention.default(q_group, None, kv_local, None, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_8 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_9 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_8)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_9)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
o_2 = merged_proj.flatten(2)""")

    def test_model_masked_fill(self):
        model = self._model(2, mask_style="masked_fill")
        be = self.dcp(model, (self._tokens(4), 0), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 0, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 0, 2, 0, 96, 0)
unsqueeze_2 = mask.unsqueeze(1)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
where = torch.where(unsqueeze_2, -inf, 0.0)
getitem = where[(None, Ellipsis)]
mask_f32 = getitem.float()
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 4, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = mask_f32, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_9 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_10 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_9)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_10)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
o_2 = merged_proj.flatten(2)""")

    def test_model_matmul_scores(self):
        # score_impl="matmul": matmul/bmm spelling of the scores and the value product
        model = self._model(2, score_impl="matmul")
        be = self.dcp(model, (self._tokens(1), 4), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat_1, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_9 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
transpose_5 = getitem_9.transpose(1, 2)
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_10 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
transpose_7 = getitem_10.transpose(1, 2)
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hfv->bshv', partial_heads_0, transpose_5)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hfv->bshv', partial_heads_1, transpose_7)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
permute = merged_proj.permute(2, 0, 1, 3)""")

    def test_tensor_positions_static_shapes(self):
        # positions as a tensor, whole-cache reads, boolean mask: the CUDA-graph-friendly form
        from kit.graphs import StaticPosMLA, _inputs

        g = torch.Generator().manual_seed(0)
        be = self.dcp(StaticPosMLA(), _inputs([5], g), c=2, comm_backend="a2a")
        self.assertRewritten(be.graphs[0])
        self.assertExpectedInline(region(be.graphs[0]), """\
striped_write = dcp_pass_runtime_decode_layout_write_tokens_at_(dcp_local_cache_0, latent, input_pos, 2, 0, 16, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_tokens_at_(dcp_local_cache_1, k_pe, input_pos, 2, 0, 16, 0)
keys = torch.arange(16, device = device(type='cpu'))
getitem = keys[(None, slice(None, None, None))]
getitem_1 = input_pos[(slice(None, None, None), None)]
future = getitem > getitem_1
unsqueeze = future.unsqueeze(1)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
where = torch.where(unsqueeze, -inf, 0.0)
getitem_5 = where[(None, Ellipsis)]
mask_f32 = getitem_5.float()
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 16, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = mask_f32, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, w_uv)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, dcp_vc_weight_0)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
flatten = merged_proj.flatten(2)""")

    def test_replicated_q_on_real_ranks(self):
        from dcp_pass.testing import run_ranks

        text = run_ranks(_replicated_region_on_gloo, 2, timeout=300)[0]
        self.assertNotIn("gather_heads", text)
        self.assertExpectedInline(text, """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
q_2 = torch._C._nn.linear(rms_norm, dcp_q_weight_1)
q_3 = q_2.view(2, 1, 2, 24)
split_2 = torch.functional.split(q_3, [16, 8], dim = -1)
q_nope_1 = split_2[0]
q_pe_2 = split_2[1]
float_3 = q_pe_2.float()
reshape_2 = float_3.reshape(2, 1, 2, -1, 2)
mul_4_as_real = dcp_pass_runtime_decode_rotary_complex_mul_real(reshape_2, rot_real)
flatten_2 = mul_4_as_real.flatten(3)
q_pe_3 = flatten_2.to(torch.bfloat16)
wkv_b_1 = dcp_q_weight_0.view(2, -1, 32)
getitem_10 = wkv_b_1[(slice(None, None, None), slice(None, 16, None))]
q_lat_1 = torch.functional.einsum('bshd,hdc->bshc', q_nope_1, getitem_10)
cat = torch.cat([q_lat, q_lat_1], 2)
cat_1 = torch.cat([q_pe_1, q_pe_3], 2)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(cat, cat_1, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_9 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_2 = dcp_q_weight_0.view(2, -1, 32)
getitem_11 = wkv_b_2[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_9)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_11)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.bfloat16)
o_2 = merged_proj.flatten(2)
---
dcp_pass report: dcp_size=2 rank=0, 1 graph(s)
  graph 0: 1 MLA layer(s) rewritten
    rewrote layers.0.attn: decode, softmax form, 2 score term(s), q replicated q-proj/w_kc, comm a2a, lse base e, attention auto, v-projection before merge (exchanges 16 instead of 32 columns per head); kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw, gluon_roles, gluon_lock_step, gluon_fp8, gluon_fp8_narrow, wide, split, per_head, flashinfer: needs CUDA tensors, the call's are on cpu)
    3 complex product(s) (rotary) computed in real arithmetic
  KV cache bytes on this rank: 30720 without DCP -> 15680 with DCP (1.96x less)
  striped cache bytes per token per layer: 80 without DCP -> 40.83 on this rank
  striped, not to be read outside compiled graphs: layers.0.attn.kv_cache, layers.0.attn.pe_cache""")

    def test_replicated_vs_gathered_q(self):
        # bf16 weights are the ones q-proj replication may take (replicate_q_proj takes bf16/fp16 only)
        regions = {}
        for replicate in (True, False):
            model = self._model(2, dtype=torch.bfloat16)
            be = self.dcp(model, (self._tokens(1), 4), c=2, comm_backend="a2a", replicate_q_proj=replicate)
            self.assertRewritten(be.graphs[0])
            regions[replicate] = region(be.graphs[0])
            torch._dynamo.reset()
        self.assertExpectedInline(regions[False], """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_9 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_10 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_9)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_10)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.bfloat16)
o_2 = merged_proj.flatten(2)""")
        # replicate_q_proj=True on the fake process group: the compile-time weight gather returns
        # identical copies, so no q weight looks sharded and the layer keeps the all-gather (the
        # report says why). The replicated graph itself runs on real gloo ranks in
        # test_pass_numerics.test_c2_bf16_replicated_q_equals_gathered_q.
        self.assertExpectedInline(regions[True], """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_1, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_9 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_10 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_9)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_10)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.bfloat16)
o_2 = merged_proj.flatten(2)""")

    def test_hybrid(self):
        from dcp_pass.models.hybrid_linear import HybridArgs, build_hybrid

        self.world(2)
        args = HybridArgs(tp_size=2, layer_pattern=["linear", "mla"], n_dense_layers=2)
        calls = [(self._tokens(1), 4)]
        plain = self.plain(build_hybrid(args, rank=0), *calls)
        be = self.dcp(build_hybrid(args, rank=0), *calls, c=2, comm_backend="a2a")
        self.assertEqual(len(be.graphs), 1)
        gm = be.graphs[0]
        self.assertRewritten(gm)
        # only the MLA layer is rewritten ...
        self.assertExpectedInline(region(gm), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, rms_norm_4, 4, 2, 0, 96, 0)
squeeze = k_pe_1.squeeze(2)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, squeeze, 4, 2, 0, 96, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
q_packed = torch.cat([q_lat, q_pe_1], -1)
q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
q_lat_group = q_group[(Ellipsis, slice(None, 32, None))]
q_rope_group = q_group[(Ellipsis, slice(32, None, None))]
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 32, scale = 0.2041241452319315, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
getitem_16 = wkv_b[(slice(None, None, None), slice(-16, None, None))]
wkv_b_1 = dcp_vc_weight_0.view(2, -1, 32)
getitem_17 = wkv_b_1[(slice(None, None, None), slice(-16, None, None))]
partial_heads = partial_out.chunk(2, 2)
partial_heads_0 = partial_heads[0]
partial_proj_0 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_0, getitem_16)
partial_heads_1 = partial_heads[1]
partial_proj_1 = torch.functional.einsum('bshf,hvf->bshv', partial_heads_1, getitem_17)
partial_proj = torch.cat([partial_proj_0, partial_proj_1], 2)
merged_proj = dcp_pass_runtime_decode_comm_exchange_a2a(partial_proj, partial_lse, '0', 2, base = 'e', out_dtype = torch.float32)
o_4 = merged_proj.flatten(2)""")
        self.assertExpectedInline(be.report.summary(), """\
dcp_pass report: dcp_size=2 rank=0, 1 graph(s)
  graph 0: 1 MLA layer(s) rewritten
    rewrote layers.1.attn: decode, softmax form, 2 score term(s), q all-gather (q weights are float32; replication takes unquantized bf16/fp16 only), comm a2a, lse base e, attention auto, v-projection before merge (exchanges 16 instead of 32 columns per head); kernel torch (auto: fallback, no other kernel takes the call; gluon_seesaw, gluon_roles, gluon_lock_step, gluon_fp8, gluon_fp8_narrow, wide, split, per_head, flashinfer: needs CUDA tensors, the call's are on cpu)
  KV cache bytes on this rank: 61440 without DCP -> 31360 with DCP (1.96x less)
  striped cache bytes per token per layer: 160 without DCP -> 81.67 on this rank
  striped, not to be read outside compiled graphs: layers.1.attn.kv_cache, layers.1.attn.pe_cache""")

        # ... and the linear-attention state is read and written exactly as before
        # (the lines naming the state buffer and the lines using what they define: view, read, copy_)
        def state_lines(gm: fx.GraphModule) -> list[str]:
            lines = [l.strip() for l in render(gm).splitlines()[1:]]
            defined = {l.split(" = ")[0] for l in lines if "attn_state" in l}
            uses = re.compile(r"\b(" + "|".join(map(re.escape, defined)) + r")\b")
            return [l for l in lines if "attn_state" in l or uses.search(l.split(" = ", 1)[-1])]

        self.assertEqual(state_lines(gm), state_lines(plain[0]))
        self.assertExpectedInline("\n".join(state_lines(gm)), """\
getitem_1 = layers_0_attn_state[slice(None, 2, None)]
state = getitem_1.float()
getitem_7 = layers_0_attn_state[slice(None, 2, None)]
copy__1 = getitem_7.copy_(state_2)""")


if __name__ == "__main__":
    unittest.main()
