"""Graph pins of the step-position rewrite (rewrites/positions.py) and its refusals.

A reference-style decode graph takes the position as an int; after the rewrite it takes
a one-element device buffer instead (`dcp_start_pos`, last input) and no int at all.
"""
from __future__ import annotations

from kit.graphs import PinCase
import torch
import torch.distributed as dist

from dcp_pass.backend import DcpBackend
from kit.graphs import TinyMLA, init_fake_world, render, tiny_inputs


class PositionsGraphTest(PinCase):
    def setUp(self):
        torch._dynamo.reset()
        init_fake_world(2)

    def tearDown(self):
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()

    def compile(self, *calls, **options):
        be = DcpBackend(dcp_size=2, inner="eager", comm_backend="a2a", static_positions=True, **options)
        compiled = torch.compile(TinyMLA(), backend=be)
        with torch.no_grad():
            for args in calls:
                compiled(*args)
        return be

    def test_decode_position_becomes_a_device_buffer(self):
        be = self.compile(tiny_inputs(1, 5), tiny_inputs(1, 6))
        gm = be.graphs[1]
        self.assertNotIn("start_pos", [n.name for n in gm.graph.find_nodes(op="placeholder")])
        self.assertExpectedInline(render(gm), """\
def forward(self, q_lat, kv_cache, latent, pe_cache, k_pe, q_pe, w_uv, dcp_local_cache_0, dcp_local_cache_1, dcp_vc_weight_0, dcp_end_pos):
    sub = torch.sub(dcp_end_pos, 1)
    arange = torch.arange(1, device = device(type='cpu'))
    add_2 = torch.add(sub, arange)
    striped_write = dcp_pass_runtime_decode_layout_write_tokens_at_(dcp_local_cache_0, latent, add_2, 2, 0, 16, 0)
    arange_1 = torch.arange(1, device = device(type='cpu'))
    add_3 = torch.add(sub, arange_1)
    striped_write_1 = dcp_pass_runtime_decode_layout_write_tokens_at_(dcp_local_cache_1, k_pe, add_3, 2, 0, 16, 0)
    kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
    pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
    q_packed = torch.cat([q_lat, q_pe], -1)
    q_group = dcp_pass_runtime_decode_comm_gather_heads(q_packed, '0', 2)
    q_lat_group = q_group[(Ellipsis, slice(None, 8, None))]
    q_rope_group = q_group[(Ellipsis, slice(8, None, None))]
    local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_group, q_rope_group, kv_local, pe_local, kv_len = -1, c = 2, rank = 0, v_dim = 8, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto', kv_lens = dcp_end_pos)
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
        self.assertIn("int step position moved to the device", be.report.summary())

    def test_layers_share_one_device_key_count(self):
        """Every layer's attention takes the same device key count, the position buffer
        itself (`dcp_end_pos`, filled with start + s): no count computed per layer (inductor
        would recompute one per op, a kernel each)."""

        class TwoLayers(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = TinyMLA(), TinyMLA()

            def forward(self, q_lat, q_pe, latent, k_pe, start_pos: int):
                out = self.a(q_lat, q_pe, latent, k_pe, start_pos)
                return out + self.b(q_lat, q_pe, latent, k_pe, start_pos)

        be = DcpBackend(dcp_size=2, inner="eager", comm_backend="a2a", static_positions=True)
        compiled = torch.compile(TwoLayers(), backend=be)
        with torch.no_grad():
            for args in (tiny_inputs(1, 5), tiny_inputs(1, 6)):
                compiled(*args)
        gm = be.graphs[1]
        attention = [n for n in gm.graph.nodes if n.target is torch.ops.dcp.mla_local_attention.default]
        self.assertEqual(len(attention), 2)
        counts = {n.kwargs["kv_lens"] for n in attention}
        self.assertEqual(len(counts), 1)
        (count,) = counts
        self.assertEqual((count.op, count.name), ("placeholder", "dcp_end_pos"))

    def test_masked_multi_token_call_keeps_its_int_and_says_why(self):
        # a causal mask [s, start + s] has a position-dependent shape: no static graph
        be = self.compile(tiny_inputs(2, 4, mask="additive"), tiny_inputs(2, 6, mask="additive"))
        summary = be.report.summary()
        self.assertIn("int position kept", summary)
        self.assertIn("has a symbolic shape", summary)
        self.assertTrue(any("start_pos" in n.name for n in be.graphs[1].graph.find_nodes(op="placeholder")))

    def test_off_by_default_on_cpu(self):
        be = DcpBackend(dcp_size=2, inner="eager", comm_backend="a2a")
        compiled = torch.compile(TinyMLA(), backend=be)
        with torch.no_grad():
            for args in (tiny_inputs(1, 5), tiny_inputs(1, 6)):
                compiled(*args)
        self.assertNotIn("dcp_start_pos", render(be.graphs[1]))
        self.assertNotIn("dcp_end_pos", render(be.graphs[1]))
