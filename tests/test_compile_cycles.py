"""Compiling, decoding and deleting a model again and again holds no more tensor memory.

Dynamo keeps every compiled function after ``torch._dynamo.reset()`` (the functions it
installs among the model module's globals), so whatever the pass's per-call feeder holds
strongly outlives the model: a gathered weight shard, a cache shard, a remembered lookup
entry. Each cycle here compiles a small DeepSeek-style model (TP=2, DCP=2, gloo, fp32)
whose graphs take the other ranks' gathered ``w_vc`` shards, decodes a ragged batch, then
deletes it and resets Dynamo; the bytes of the live real tensors must stay flat.
"""
from __future__ import annotations

import gc

import pytest
import torch

from dcp_pass.testing import run_ranks

CYCLES = 3


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live real tensor (fake and meta ones own none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    storages: dict[tuple[int, int], int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(storages.values())


def _cycles(rank, world):
    import warnings

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model
    from dcp_pass.models.generate import greedy_generate

    warnings.simplefilter("ignore", FutureWarning)  # gc.get_objects() meets torch's deprecated aliases
    torch.set_grad_enabled(False)
    live, gathered = [], []
    for cycle in range(CYCLES):
        torch.manual_seed(cycle)
        model = build_model(ModelArgs(n_layers=2, n_dense_layers=2))
        backend = DcpBackend(dcp_size=world, inner="aot_eager")
        compiled = torch.compile(model, backend=backend)
        greedy_generate(compiled, [[11, 5, 42], [9], [3, 8]], 3)
        gathered.append(sum(node.op == "placeholder" and node.name.startswith(("dcp_vc_weight", "dcp_q_weight"))
                            for gm in backend.graphs for node in gm.graph.nodes))
        del model, backend, compiled
        torch._dynamo.reset()
        gc.collect()
        live.append(_live_tensor_bytes())
    return live, gathered


@pytest.mark.slow
def test_compile_decode_delete_cycles_keep_live_tensor_bytes_flat():
    for rank, (live, gathered) in enumerate(run_ranks(_cycles, 2)):
        assert all(gathered), f"rank {rank}: the graphs took no gathered weight, nothing is tested: {gathered}"
        # after the first cycle (which may set up process-wide state once) nothing grows
        assert live[1:] == [live[1]] * (CYCLES - 1), f"rank {rank}: live tensor bytes per cycle {live}"
