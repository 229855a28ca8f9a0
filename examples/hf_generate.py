"""A Hugging Face model with a static cache, unmodified, under `generate` with DCP on 2 ranks.

    pip install -e '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_generate.py

`tp_size=1`: every rank holds the whole model, and each stores only its stripe of every
cache tensor. The model is compiled in place (`model.compile`) so that `generate` calls the
compiled forward. A tiny random DeepseekV3 stands in for a checkpoint: load yours with
`from_pretrained` instead.
"""
import torch
import torch.distributed as dist
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import dcp_pass

if not dist.is_initialized():
    dist.init_process_group("gloo")

config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                          qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
torch.manual_seed(0)
model = DeepseekV3ForCausalLM(config).eval()
prompt = torch.tensor([[3, 5, 7, 9]])
with torch.no_grad():
    want = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="static")
model.compile(backend="dcp", options={"dcp_size": dist.get_world_size(), "tp_size": 1, "inner": "aot_eager"})
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="static")
assert torch.equal(out, want), (out, want)
if dist.get_rank() == 0:
    print(out)
    print(dcp_pass.last_report().summary())  # per-head attention layers rewritten, cache bytes per rank
