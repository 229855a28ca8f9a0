"""A regression test of what the pass does to your model: the rewritten decode graph, pinned.

    python examples/pin_graphs.py                      # checks the pin
    EXPECTTEST_ACCEPT=1 python examples/pin_graphs.py  # rewrites the pin in place after a deliberate change

`dcp_pass.testing.graph_stages` compiles a copy of the model on an in-process fake process
group (shapes right, values not; no ranks to start) and returns, per compiled graph, its
code as captured and after each pass, with Dynamo's long names shortened so the text is
stable. It makes its own process group: run it where torch.distributed is not set up.
Put your model and its calls where the forms model is built.
"""
import unittest

import expecttest
import torch

from dcp_pass.models.mla_forms import FormArgs, build_forms_model
from dcp_pass.testing import graph_stages


class PinnedGraphs(expecttest.TestCase):
    def test_decode_step_on_two_ranks(self):
        model = build_forms_model(FormArgs(form="sdpa", n_layers=1), seed=0)  # your model here
        tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
        stages = graph_stages(model, [(tokens[:, :4], 0), (tokens[:, 4:5], 4)], {"dcp_size": 2})
        decode = stages[-1]["attention"]  # the decode graph after the attention rewrite
        body = decode.splitlines()[1:]  # past the signature
        dcp_lines = "\n".join(line.strip() for line in body if "dcp" in line)
        self.assertExpectedInline(dcp_lines, """striped_write = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_0, latent_1, start_pos, 2, 0, 48, 0)
striped_write_1 = dcp_pass_runtime_decode_layout_write_owned_tokens_(dcp_local_cache_1, k_pe_1, start_pos, 2, 0, 48, 0)
kv_local = dcp_local_cache_0[(slice(None, 2, None),)]
pe_local = dcp_local_cache_1[(slice(None, 2, None),)]
local_attention = torch.ops.dcp.mla_local_attention.default(q_abs, q_pe_1, kv_local, pe_local, kv_len = add, c = 2, rank = 0, v_dim = 16, scale = 0.25, mask = None, lse_base = 'e', backend = 'auto')
merged = dcp_pass_runtime_decode_comm_exchange_replicated(partial_out, partial_lse, '0', 2, method = 'a2a', base = 'e', out_dtype = torch.float32)""")  # noqa: E501


if __name__ == "__main__":
    unittest.main()
