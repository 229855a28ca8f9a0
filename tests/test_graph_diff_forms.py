"""What the pass does to each way of writing MLA (dcp_pass.models.mla_forms), pinned.

Each case compiles one layer of the forms model through `dcp_pass.testing.graph_stages`
(the public helper a user pins their own model with: a fake group of 2 ranks, rank 0) with
a prefill and one decode call, and pins the attention region of the decode graph after the
`attention` pass: from the first striped write to the merged output in the model's layout;
one more pins, for every form, the value projection moved before the exchange by the
`project_before_merge` pass.
Regenerate after an intended change with EXPECTTEST_ACCEPT=1 and read the diff.
"""
from __future__ import annotations

import unittest

from kit.graphs import PinCase
import torch

from dcp_pass.models.mla_forms import FormArgs, build_forms_model
from dcp_pass.testing import graph_stages


def attention_region(code: str) -> str:
    """From the first striped write to the last line that uses the merged output's layout."""
    lines = [line.strip() for line in code.splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("striped_write"))
    merged = next(i for i, line in enumerate(lines) if line.startswith("merged = "))
    last = merged
    while last + 1 < len(lines) and lines[last + 1].split(" = ")[0].startswith("merged"):
        last += 1
    return "\n".join(lines[first:last + 1])


def decode_stages(form: str, start: int = 5, **kw) -> dict[str, str]:
    model = build_forms_model(FormArgs(form=form, n_layers=1, **kw), seed=0)
    tokens = torch.randint(0, 96, (2, start + 1), generator=torch.Generator().manual_seed(0))
    stages = graph_stages(model, [(tokens[:, :start], 0), (tokens[:, start:], start)], {"dcp_size": 2})
    return stages[-1]


class FormsGraphDiffTest(PinCase):
    def test_stages_are_every_pass_in_order(self):
        stages = decode_stages("einsum")
        self.assertEqual(list(stages), ["captured", "allocated_caches", "match", "striped_writes", "query_replication",
                                        "attention", "project_before_merge", "verify_buffers", "complex_as_real",
                                        "install_shards", "device_positions"])
        self.assertIn("torch.functional.einsum('bsht,btc->bshc'", stages["captured"])
        self.assertNotIn("torch.functional.einsum('bsht,btc->bshc'", stages["attention"])

    def test_every_form_projects_before_the_merge(self):
        # after the project_before_merge pass: the value up-projection of the partial output,
        # the exchange of v_head_dim columns, and what the model's code reads
        from dcp_pass.models.mla_forms import FORMS

        regions = []
        for form in FORMS:
            if form == "flex_sink":  # the model reads the LSE of the same exchange: the projection stays after it
                continue
            lines = [line.strip() for line in decode_stages(form)["project_before_merge"].splitlines()]
            first = next(i for i, line in enumerate(lines) if line.startswith("partial_proj"))
            merged = next(i for i, line in enumerate(lines) if line.startswith("merged_proj = "))
            regions.append(f"{form}:\n" + "\n".join(lines[first:merged + 2]))
        self.assertExpectedInline("\n".join(regions), """\
einsum:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_14)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
sdpa:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_18)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
sdpa_gqa:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_14)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
sdpa_causal:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_18)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
mqa_matmul:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_13)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
fused_unsqueeze:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_13)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
window:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_14)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
paged:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_16)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_5 = merged_proj.flatten(2)
flex:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_18)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
flatten_2 = merged_proj.flatten(2)
sink:
partial_proj = torch.functional.einsum('bshf,hvf->bshv', partial_out, getitem_15)
merged_proj = dcp_pass_runtime_decode_comm_exchange_replicated(partial_proj, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32, return_lse = True)
merged_proj_out = merged_proj[0]""")

    def test_sdpa(self):
        self.assertExpectedInline(attention_region(decode_stages("sdpa")["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, start_pos, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, start_pos, 2, 0, 48, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged.permute(0, 2, 1, 3)""")

    def test_sdpa_gqa_default_scale(self):
        self.assertExpectedInline(attention_region(decode_stages("sdpa_gqa")["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, start_pos, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, start_pos, 2, 0, 48, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.20412414523193154, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged.permute(0, 2, 1, 3)""")

    def test_sdpa_is_causal_prefill(self):
        model = build_forms_model(FormArgs(form="sdpa_causal", n_layers=1), seed=0)
        tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
        (stages,) = graph_stages(model, [(tokens, 0)], {"dcp_size": 2})
        self.assertExpectedInline(attention_region(stages["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, 0, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, 0, 2, 0, 48, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
query_rows = q_abs.size(1)
causal_rows = torch.arange(query_rows, device = device(type='cpu'))
causal_q_pos = causal_rows.unsqueeze(0)
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = 5, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto', q_pos = causal_q_pos)
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged.permute(0, 2, 1, 3)""")

    def test_mqa_matmul(self):
        self.assertExpectedInline(attention_region(decode_stages("mqa_matmul")["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(shard_rows, written_rows, start_pos, 2, 0, 48, 0)
cat_1 = torch.cat([q_abs, q_pe_1], dim = -1)
q_1 = cat_1.transpose(1, 2)
kv_local = dcp_local_cache_0[(slice(None, 2, None), slice(None, None, None), 0)]
q_lat_bshd = q_1.permute(0, 2, 1, 3)
local_attention = torch.ops.dcp.mla_local_attention.default(q_lat_bshd, None, kv_local, None, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)
merged_layout = merged.permute(0, 2, 1, 3)""")

    def test_fused_cache_unsqueezed_first(self):
        self.assertExpectedInline(attention_region(decode_stages("fused_unsqueeze")["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, cat, start_pos, 2, 0, 48, 0)
q_1 = torch.cat([q_abs, q_pe_1], dim = -1)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_1, None, kv_local, None, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)""")

    def test_sliding_window(self):
        self.assertExpectedInline(attention_region(decode_stages("window", start=12)["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, start_pos, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, start_pos, 2, 0, 48, 0)
sub_2 = add - 8
sym_max = torch.sym_max(0, sub_2)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto', kv_start = sym_max)
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)""")

    def test_paged_pool(self):
        self.assertExpectedInline(attention_region(decode_stages("paged")["attention"]), """\
striped_write = dcp_pass_runtime_decode_layout_write_tokens_at_(pool_slots, written_slots, slots, 2, 0, 192, 0)
q_1 = torch.cat([q_abs, q_pe_1], dim = -1)
pool_local = dcp_local_cache_0[slice(None, 96, None)]
pages_local = pool_local.view(24, 4, 24)
gathered_local = pages_local[table]
kv_local = gathered_local.flatten(1, 2)
local_attention = torch.ops.dcp.mla_local_attention.default(q_1, None, kv_local, None, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)""")

    def test_sink_after_the_merge(self):
        # the scores without the sink column; the exchange returns the merged LSE too, and the
        # sink logits [B, S, H] fold into the merged output once, after the merge
        code = decode_stages("sink")["attention"]
        lines = [line.strip() for line in code.splitlines()]
        first = next(i for i, line in enumerate(lines) if line.startswith("striped_write"))
        last = next(i for i, line in enumerate(lines) if line.startswith("merged_sink = "))
        self.assertExpectedInline("\n".join(lines[first:last + 1]), """\
striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, start_pos, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, start_pos, 2, 0, 48, 0)
view_6 = layers_0_attn_sinks.view(1, 1, -1, 1)
sinks = view_6.expand(2, 1, -1, 1)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
partial_out = local_attention[0]
partial_lse = local_attention[1]
merged_both = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32, return_lse = True)
merged = merged_both[0]
merged_lse = merged_both[1]
sink_bsh = sinks[(Ellipsis, 0)]
merged_sink = dcp_pass_runtime_decode_merge_fold_sink(merged, merged_lse, sink_bsh, 'e', torch.float32)""")

    def test_flex_lse_read_by_the_model(self):
        # flex_attention's LSE (base 2, [B, H, S]) that the model reads is the merged LSE (base e,
        # [B, S, H]) converted back; the model's own sink code then runs on it
        code = decode_stages("flex_sink")["attention"]
        lines = [line.strip() for line in code.splitlines()]
        first = next(i for i, line in enumerate(lines) if line.startswith("merged_both"))
        last = next(i for i, line in enumerate(lines) if line.startswith("merged_lse_model = "))
        self.assertExpectedInline("\n".join(lines[first:last + 1]), """\
merged_both = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32, return_lse = True)
merged = merged_both[0]
merged_lse = merged_both[1]
merged_lse_base = merged_lse * 1.4426950408889634
merged_lse_layout = merged_lse_base.permute(0, 2, 1)
merged_lse_model = merged_lse_layout.to(torch.float32)""")


if __name__ == "__main__":
    unittest.main()
