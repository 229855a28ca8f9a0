"""Fixtures shared by the test files."""
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_world():
    """A fake 2-rank process group (this process is rank 0) and a fresh Dynamo, torn down after."""
    from test_graph_diff import init_fake_world

    torch._dynamo.reset()
    init_fake_world(2)
    yield
    torch._dynamo.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
