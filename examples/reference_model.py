"""Decode with DCP on 2 ranks and check the tokens against the model without it.

    torchrun --nproc-per-node 2 examples/reference_model.py

The model is the package's DeepSeek-style reference model (absorbed MLA, TP over all ranks);
put your own model where it is built. On CPU the ranks use gloo; on a GPU drop
`"inner": "aot_eager"` (inductor and CUDA graphs are the default there).
"""
import torch
import torch.distributed as dist

import dcp_pass
from dcp_pass.models.deepseek_mla import ModelArgs, build_model
from dcp_pass.models.generate import greedy_generate

if not dist.is_initialized():
    dist.init_process_group("gloo")
torch.set_grad_enabled(False)

prompts = [[11, 5, 42, 7], [9], [3, 8, 1]]  # a ragged batch
torch.manual_seed(0)
reference = build_model(ModelArgs(n_layers=2, n_dense_layers=2, dtype=torch.float32))
torch.manual_seed(0)  # the same weights again
model = build_model(ModelArgs(n_layers=2, n_dense_layers=2, dtype=torch.float32))
compiled = torch.compile(model, backend="dcp", options={"dcp_size": dist.get_world_size(), "inner": "aot_eager"})

want, _ = greedy_generate(reference, prompts, 6)
got, _ = greedy_generate(compiled, prompts, 6)
assert got == want, (got, want)  # fp32: the same tokens, step for step
if dist.get_rank() == 0:
    print(dcp_pass.last_report().summary())  # the layers rewritten, KV bytes per rank
    print("tokens match the model without DCP:", got)
