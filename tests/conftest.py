"""Fixtures shared by the test files."""
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_world():
    """A fake 2-rank process group (this process is rank 0) and a fresh Dynamo, torn down after."""
    from kit.graphs import init_fake_world

    torch._dynamo.reset()
    init_fake_world(2)
    yield
    torch._dynamo.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_across_files():
    """Every test file starts and ends without a default process group: a model built in the
    test process (the eager references) reads its TP degree from torch.distributed, so a fake
    2-rank group an earlier file of the same xdist worker left would shard it over ranks that
    do not exist."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Tests that drive a model in this process turn autograd off as a user's inference
    script does (`torch.set_grad_enabled(False)`); the next test in the same worker gets
    the mode it started with."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def pytest_collection_modifyitems(session, config, items):
    """Files holding multi-process (``slow``) tests run first. Under pytest-xdist
    (``-n 2 --dist loadfile``, the README's command) a worker takes whole files in this
    order, so the minutes-long multi-rank compiles start at once and the many short files
    fill in around them instead of leaving one worker alone with a long file at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order inside kept
