"""Option 'cudagraphs': CUDA graphs from the options dict.

`torch.compile(m, backend="dcp", options={...}, mode="reduce-overhead")` is refused by
torch.compile itself, so a backend reached by name gets CUDA graphs only through its
options. The patch dict is a pure function of (options, device, mode), tested here for
CPU and CUDA devices without a GPU; the wiring into the inductor compile is checked with
the device and compile_fx stubbed.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass.options import DcpOptionError, DcpOptions

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _patches(device, mode=None, **options):
    from dcp_pass.backend import inner_config_patches

    return inner_config_patches(DcpOptions.from_mapping(options), device, mode)


def test_cudagraphs_option_validation():
    assert DcpOptions.from_mapping({}).cudagraphs == "auto"
    for value in ("auto", True, False):
        assert DcpOptions.from_mapping({"cudagraphs": value}).cudagraphs == value
    for bad in ("yes", 1, 0, None, "on"):
        with pytest.raises(DcpOptionError, match="'cudagraphs'"):
            DcpOptions.from_mapping({"cudagraphs": bad})
    with pytest.raises(DcpOptionError, match="'cudagraphs'=True needs inner='inductor'"):
        DcpOptions.from_mapping({"cudagraphs": True, "inner": "aot_eager"})
    DcpOptions.from_mapping({"cudagraphs": False, "inner": "eager"})  # off is fine anywhere
    with pytest.raises(DcpOptionError, match="disagree"):
        DcpOptions.from_mapping({"cudagraphs": True, "inner_options": {"triton.cudagraphs": False}})


def test_inner_config_patches():
    # auto: on for CUDA under inductor, nothing on CPU or for other inner compilers
    assert _patches(CUDA) == {"triton.cudagraphs": True}
    assert _patches(CPU) == {}
    assert _patches(CUDA, inner="aot_eager") == {}
    assert _patches(CUDA, inner="eager") == {}
    # forced
    assert _patches(CUDA, cudagraphs=True) == {"triton.cudagraphs": True}
    assert _patches(CUDA, cudagraphs=False) == {"triton.cudagraphs": False}
    assert _patches(CPU, cudagraphs=False) == {"triton.cudagraphs": False}
    with pytest.raises(DcpOptionError, match="'cudagraphs'=True needs CUDA tensors, the model is on cpu"):
        _patches(CPU, cudagraphs=True)
    # a mode (DcpBackend given mode=): auto follows it, True/False override its choice
    assert _patches(CUDA, mode="reduce-overhead") == {"triton.cudagraphs": True}
    assert _patches(CPU, mode="reduce-overhead") == {"triton.cudagraphs": True}  # as plain inductor
    assert "triton.cudagraphs" not in _patches(CUDA, mode="max-autotune-no-cudagraphs")
    assert _patches(CUDA, mode="max-autotune-no-cudagraphs")["max_autotune"] is True
    assert _patches(CUDA, mode="reduce-overhead", cudagraphs=False) == {"triton.cudagraphs": False}
    assert _patches(CUDA, mode="max-autotune", cudagraphs=False)["triton.cudagraphs"] is False
    assert _patches(CUDA, mode="default") == {"triton.cudagraphs": True}
    # inner_options come last
    assert _patches(CUDA, inner_options={"triton.cudagraphs": False}) == {"triton.cudagraphs": False}
    assert _patches(CPU, inner_options={"max_autotune": True}) == {"max_autotune": True}
    assert _patches(CUDA, inner_options={"max_autotune": True}) == {"triton.cudagraphs": True, "max_autotune": True}


def _stub_inductor(monkeypatch, device):
    """compile_fx records its config patches; the model's tensors report `device`."""
    import torch._inductor.compile_fx as cfx

    import dcp_pass.backend as backend

    seen = []

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    monkeypatch.setattr(backend, "_device_of", lambda example_inputs: torch.device(device))
    return seen


@pytest.mark.parametrize("device,options,want", [
    ("cuda", {}, {"triton.cudagraphs": True}),
    ("cuda", {"cudagraphs": False}, {"triton.cudagraphs": False}),
    ("cuda", {"cudagraphs": True, "inner_options": {"max_autotune": True}},
     {"triton.cudagraphs": True, "max_autotune": True}),
    ("cpu", {}, None),
    ("cpu", {"cudagraphs": "auto"}, None),
])
def test_compile_hands_patches_to_inductor(monkeypatch, device, options, want):
    import torch._dynamo

    seen = _stub_inductor(monkeypatch, device)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sin(), backend="dcp", options={"inner": "inductor", **options})
    x = torch.randn(3)
    torch.testing.assert_close(fn(x), (x * 2).sin())
    assert seen == [want]
    torch._dynamo.reset()


def test_cudagraphs_true_on_cpu_raises_at_compile():
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + 1, backend="dcp", options={"cudagraphs": True})
    with pytest.raises(Exception, match="'cudagraphs'=True needs CUDA tensors") as info:
        fn(torch.randn(3))
    assert "DcpOptionError" in str(info.value) or isinstance(info.value, DcpOptionError)
    torch._dynamo.reset()


def test_cudagraphs_auto_on_cpu_compiles_with_inductor():
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 3).cos(), backend="dcp", options={"cudagraphs": "auto"})
    x = torch.randn(5)
    torch.testing.assert_close(fn(x), (x * 3).cos())
    torch._dynamo.reset()


class _LazyCache(torch.nn.Module):
    """Allocates its cache on the first call, inside the compiled region, as a Hugging Face
    StaticCache does in the prefill; later calls only write into it."""

    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.zeros(4, x.shape[-1])
        self.cache[: x.shape[0]] = x
        return self.cache.sum(0) * 2


@pytest.mark.parametrize("options,want", [
    ({}, [{"triton.cudagraphs": False}, {"triton.cudagraphs": True}]),  # auto: not for the allocating call
    ({"cudagraphs": True}, [{"triton.cudagraphs": True}] * 2),  # forced stays forced
])
def test_graph_that_builds_state_runs_without_cudagraphs(monkeypatch, options, want):
    import torch._dynamo

    seen = _stub_inductor(monkeypatch, "cuda")
    torch._dynamo.reset()
    model = _LazyCache()
    fn = torch.compile(model, backend="dcp", options={"inner": "inductor", **options})
    x = torch.randn(2, 3)
    torch.testing.assert_close(fn(x), 2 * x.sum(0))
    # the state is marked as the model would mark it when allocated eagerly (HF's StaticCache
    # does), so the graphs that later update it keep CUDA graphs
    marked = getattr(model.cache, "_dynamo_static_input_type", None)
    assert marked == ("unguarded" if not options else None)
    torch.testing.assert_close(fn(x + 1), 2 * (x + 1).sum(0))
    assert seen == want
    torch._dynamo.reset()


def test_state_built_in_graph():
    import torch.fx as fx

    from dcp_pass.rewrites.fx_util import state_built_in_graph

    def lazy(x, counter):
        cache = x.new_zeros(4, 3)
        cache[:2].copy_(x)  # written through a view
        step = counter.to(torch.float64)
        step.add_(1)
        counter.add_(1)  # an input: the caller's state, not built here
        logits = x * 2  # computed, never written: not state
        return cache, step, logits, counter

    graph = fx.symbolic_trace(lazy).graph
    assert state_built_in_graph(graph) == ["new_zeros", "to"]


def test_prefill_that_allocates_stripes_marks_the_cache_counter_static(monkeypatch):
    """Hugging Face's StaticCache (transformers >= 5.25) keeps a device step counter,
    `cumulative_length`, made in the prefill and advanced in place by every decode step; the
    model marks it static only when its prefill runs eagerly. The pass compiles the prefill
    (it allocates the cache's stripes there), so it marks the counter itself: without that,
    CUDA graph trees run every decode step eagerly (a decode graph that mutates an input
    which is neither a parameter nor static is not captured)."""
    import torch._dynamo
    from hf_tiny import tiny_model
    from transformers import StaticCache

    _stub_inductor(monkeypatch, "cuda")
    torch._dynamo.reset()
    model = tiny_model("llama_gqa")
    cache = StaticCache(config=model.config, max_cache_len=12)
    if not hasattr(cache.layers[0], "cumulative_length"):
        pytest.skip("this transformers' StaticCache keeps no device step counter")
    fn = torch.compile(model, backend="dcp", options={"inner": "inductor", "dcp_size": 1, "fast_path": True})
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fn(input_ids=ids, past_key_values=cache, use_cache=True)
    counters = [layer.cumulative_length for layer in cache.layers]
    assert all(getattr(c, "_dynamo_static_input_type", None) == "unguarded" for c in counters), counters
    torch._dynamo.reset()
