"""The attention op's replay (dcp_pass/runtime/decode/replay.py).

CPU: the recording logic with a stand-in Triton kernel (an object with the compiled
kernel's launcher interface that records what it is given): every pointer of a replay is
the same byte offset into the new call's inputs and fresh buffers as in the recorded
call, constants stay, and a call that did anything but allocate and take views is never
replayed. GPU (skipped without CUDA): the real op, replayed vs its Python path, equal
bit for bit on the split and the wide kernel, and captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from dcp_pass.runtime.decode import replay
from dcp_pass.runtime.decode.kernels.common import launch


def _kernel_params(Q, O, n, scale, BLOCK=16, FLAG=False):  # a kernel's parameters, constexprs last
    pass


class _Compiled:
    """Stands in for Triton's CompiledKernel: its launcher records each call."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], object(), object()

    def run(self, g0, g1, g2, stream, function, packed_metadata, metadata, enter, exit_, *args):
        assert function is self.function and packed_metadata is self.packed_metadata
        self.calls.append(((g0, g1, g2), args))


class _Jit:
    """Stands in for a JITFunction with `fn`'s parameters: `jit[grid](...)` launches (records)
    and returns the compiled kernel."""

    def __init__(self, fn=_kernel_params):
        self.signature = inspect.signature(fn)
        self.compiled = _Compiled()
        self.python_launches = 0

    def __getitem__(self, grid):
        def call(*args, **options):
            self.python_launches += 1
            self.compiled.calls.append((tuple(grid) + (1,) * (3 - len(grid)),
                                        tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in
                                              self._bind(args, options))))
            return self.compiled
        return call

    def _bind(self, args, options):
        bound = self.signature.bind(*args, **{k: v for k, v in options.items() if k in self.signature.parameters})
        bound.apply_defaults()
        return list(bound.arguments.values())


def _python_path(kernel, q, kv, counter, extra_op=False, replayable=True):
    def call():
        counter.append(1)
        out = torch.empty(q.shape[0], 3, dtype=q.dtype)  # an output
        scratch = q.new_empty(2, 5)  # a buffer only the kernel sees
        view = kv[:, 1:]  # a view of an input, at an offset
        if extra_op:
            view = view.clone()  # data-dependent: not replayable
        launch(kernel, (2, 3), (view, out, q.shape[0], 0.5), dict(BLOCK=32), 4)
        launch(kernel, (1,), (scratch, out, 7, 1.5), dict(FLAG=True), 8, 2)
        lse = torch.empty(q.shape[0])
        return (out, lse), replayable  # as the op's Python path: result, and may it be replayed
    return call


def test_replay_points_into_the_new_inputs_and_fresh_buffers():
    kernel, counter = _Jit(), []
    q, kv = torch.randn(4, 8), torch.randn(4, 6)
    key = replay.signature("case", tensors=(q, kv))
    out0, lse0 = replay.run(key, (q, kv), _python_path(kernel, q, kv, counter))
    recorded = list(kernel.compiled.calls)
    assert len(recorded) == 2 and len(counter) == 1

    q2, kv2 = torch.randn(4, 8), torch.randn(4, 6)  # same signature, new memory
    out1, lse1 = replay.run(key, (q2, kv2), _python_path(kernel, q2, kv2, counter))
    assert len(counter) == 1 and kernel.python_launches == 2  # no Python path, no Triton binding
    (g_a, args_a), (g_b, args_b) = kernel.compiled.calls[2:]
    assert g_a == (2, 3, 1) and g_b == (1, 1, 1)
    row = kv2.stride(0) * kv2.element_size()
    assert args_a == (kv2.data_ptr() + kv2.element_size(), out1.data_ptr(), 4, 0.5, 32, False)
    assert args_b[1:] == (out1.data_ptr(), 7, 1.5, 16, True) and args_b[0] not in (out1.data_ptr(), lse1.data_ptr())
    assert row > 0 and out1.shape == out0.shape and lse1.shape == lse0.shape
    assert out1.data_ptr() != out0.data_ptr()  # fresh outputs every call
    # the recorded call's own pointers were of its own inputs
    assert recorded[0][1][0] == kv.data_ptr() + kv.element_size()


def test_a_call_that_computes_is_never_replayed():
    kernel, counter = _Jit(), []
    q, kv = torch.randn(2, 8), torch.randn(2, 6)
    key = replay.signature("computes", tensors=(q, kv))
    for _ in range(3):
        replay.run(key, (q, kv), _python_path(kernel, q, kv, counter, extra_op=True))
    assert len(counter) == 3 and kernel.python_launches == 6


def test_a_backend_that_may_launch_unseen_work_is_never_replayed():
    """Only kernels marked replayable in the registry are: a library kernel launched outside
    kernels.common.launch would be invisible to the recording and skipped by a replay."""
    from dcp_pass.runtime.decode.kernels.registry import KERNELS, TRITON_KERNELS

    kernel, counter = _Jit(), []
    q, kv = torch.randn(2, 8), torch.randn(2, 6)
    key = replay.signature("library backend", tensors=(q, kv))
    for _ in range(3):
        replay.run(key, (q, kv), _python_path(kernel, q, kv, counter, replayable=False))
    assert len(counter) == 3
    assert {n for n, k in KERNELS.items() if k.replayable} == set(TRITON_KERNELS)


def test_inputs_sharing_memory_are_not_replayed_and_replay_can_be_turned_off(monkeypatch):
    kernel, counter = _Jit(), []
    base = torch.randn(2, 14)
    q, kv = base[:, :8], base[:, 8:]  # one storage: which input a pointer came from is ambiguous
    key = replay.signature("aliased", tensors=(q, kv))
    for _ in range(2):
        replay.run(key, (q, kv), _python_path(kernel, q, kv, counter))
    assert len(counter) == 2
    monkeypatch.setenv("DCP_REPLAY", "0")
    q, kv = torch.randn(2, 8), torch.randn(2, 6)
    key = replay.signature("off", tensors=(q, kv))
    for _ in range(2):
        replay.run(key, (q, kv), _python_path(kernel, q, kv, counter))
    assert len(counter) == 4


@dataclasses.dataclass
class _Descriptor:
    """Stands in for a host TMA descriptor: Triton's launcher reads `base.data_ptr()` at launch."""
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list


def _gluon_descriptor(t: torch.Tensor):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [2, 32], layout)


def _descriptor_path(kernel, kv, counter, make):
    """A call whose kernel reads one input through a descriptor built on a view of it (the
    narrow fp8 kernel's cache tiles: a dtype view of the latent's columns)."""
    def call():
        counter.append(1)
        out = torch.empty(kv.shape[0], 3)
        words = kv[:, 16:].view(torch.int32)  # 16 bytes into each row, reinterpreted
        launch(kernel, (2,), (make(words), out, kv.shape[0], 0.5), {}, 4)
        return (out,), True
    return call


def _stand_in(t: torch.Tensor):
    return _Descriptor(t, list(t.shape), list(t.stride()), [2, 32])


@pytest.mark.parametrize("make", [_stand_in, _gluon_descriptor], ids=["stand-in", "gluon"])
def test_replay_moves_each_descriptor_to_the_new_call_s_tensor(make):
    """Two layers' caches share a signature (it holds no addresses): the second layer's replay
    must read its own cache, not the recorded first layer's (Triton's launcher takes a
    descriptor's address from its base object at every launch)."""
    if make is _gluon_descriptor:
        pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    kernel, counter = _Jit(), []
    layers = [torch.randn(4, 64).view(torch.uint8) for _ in range(3)]  # [4, 256] bytes, rows 16-byte aligned
    key = replay.signature("descriptor", make.__name__, tensors=(layers[0],))
    assert all(replay.signature("descriptor", make.__name__, tensors=(kv,)) == key for kv in layers)
    for step in range(2):
        for kv in layers:
            replay.run(key, (kv,), _descriptor_path(kernel, kv, counter, make))
    assert len(counter) == 1  # the first call recorded, the other five replayed
    replayed = kernel.compiled.calls[1:]
    assert len(replayed) == 5
    for (grid, args), kv in zip(replayed, layers[1:] + layers):
        d = args[0]
        assert grid == (2, 1, 1) and args[2:] == (4, 0.5, 16, False)
        assert d.base.data_ptr() == kv.data_ptr() + 16  # this layer's cache, at the view's offset
        assert list(d.shape) == [4, 60] and list(d.strides) == [64, 1] and list(d.block_shape) == [2, 32]
    # one descriptor object per cache for the whole run; none holds a tensor (no cache kept alive)
    assert replayed[3][1][0] is replayed[0][1][0] and not isinstance(replayed[0][1][0].base, torch.Tensor)


def test_the_narrow_fp8_kernel_s_arguments_replay_onto_each_layer_s_cache():
    """The narrow fp8 kernel's own argument list (its launch_args on CPU tensors, launched through a
    stand-in with its parameters): replayed for other layers' packed rows, every descriptor reads
    that layer's rows and no argument names the recorded layer's memory."""
    from dcp_pass.runtime.decode.kernels.gluon import fp8_narrow as narrow
    from dcp_pass.runtime.decode.call import AttentionCall
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, views

    if not narrow.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    layout = Fp8Layout(512, 64, torch.bfloat16)
    B, T, H = 2, 256, 16
    q = torch.randn(B, 1, H, 576).to(torch.bfloat16)
    lens = torch.tensor([2 * T - 1, 7])
    layers = [torch.zeros(B, T, layout.row_bytes, dtype=torch.uint8) for _ in range(3)]
    kernel, counter = _Jit(narrow._narrow_kernel_src), []

    def path(kv):
        def call():
            counter.append(1)
            latent, scales, rope = views(kv, layout)
            c = AttentionCall(q[..., :512], q[..., 512:], latent, rope, 512, 0.1, kv_lens=lens, stripe=(2, 1),
                              kv_scale=scales)
            out, lse, (grid, args, consts, _) = narrow.launch_args(c.shard(), num_splits=4)
            launch(kernel, grid, args, consts, 4)
            return (out, lse), True
        return call

    key = replay.signature("narrow fp8", tensors=(q, layers[0], lens))
    for kv in layers + layers:
        replay.run(key, (q, kv, lens), path(kv))
    assert len(counter) == 1 and len(kernel.compiled.calls) == 6
    for (_, args), kv in zip(kernel.compiled.calls[1:], layers[1:] + layers):
        descriptors = [a for a in args if hasattr(a, "block_shape")]
        assert len(descriptors) == 3
        for d in descriptors:
            assert kv.data_ptr() <= d.base.data_ptr() < kv.data_ptr() + kv.nbytes
        for other in layers:
            if other is not kv:
                assert not any(isinstance(a, int) and other.data_ptr() <= a < other.data_ptr() + other.nbytes
                               for a in args)


def test_an_argument_that_may_name_memory_is_never_replayed():
    kernel, counter = _Jit(), []
    kv = torch.randn(2, 6)

    def call():
        counter.append(1)
        out = torch.empty(2, 3)
        launch(kernel, (1,), ([kv], out, 2, 0.5), {}, 4)  # a list holding a tensor: its address is not seen
        return (out,), True

    key = replay.signature("opaque argument", tensors=(kv,))
    for _ in range(2):
        replay.run(key, (kv,), call)
    assert len(counter) == 2 and kernel.python_launches == 2


def test_signature_tells_apart_what_the_python_path_depends_on():
    a = torch.randn(4, 8)
    base = replay.signature("x", 1, tensors=(a, None))
    assert base == replay.signature("x", 1, tensors=(torch.randn(4, 8), None))
    assert base != replay.signature("x", 2, tensors=(a, None))
    assert base != replay.signature("x", 1, tensors=(a.t().contiguous().t(), None))  # strides
    assert base != replay.signature("x", 1, tensors=(a.double(), None))
    assert base != replay.signature("x", 1, tensors=(torch.randn(64)[1:33].view(4, 8), None))  # misaligned pointer
    assert base != replay.signature("x", 1, tensors=(a, a))


# ---------------------------------------------------------------- GPU: the real op
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _op_inputs(B, H, T, mask):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, H, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    qr = torch.randn(B, 1, H, 64, dtype=torch.bfloat16, device="cuda", generator=g)
    kv = torch.randn(B, T + 1, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    pe = torch.randn(B, T + 1, 64, dtype=torch.bfloat16, device="cuda", generator=g)
    m = None
    if mask:
        m = torch.zeros(B, 1, 1, 2 * (T + 1), device="cuda")  # global width: c x the shard's rows
        m[..., 3::7] = float("-inf")
    return q, qr, kv, pe, m


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])  # the split kernel and the wide kernel
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.gpu_full
def test_gpu_replay_equals_the_python_path(monkeypatch, H, per_row, mask):
    import dcp_pass.runtime.decode.ops  # noqa: F401

    B, T, c, rank = 4, 2048, 2, 1
    q, qr, kv, pe, m = _op_inputs(B, H, T, mask)
    lens = torch.tensor([2 * T - 3, 5, 0, T + 1] if per_row else [2 * T - 1], device="cuda")
    call = lambda: torch.ops.dcp.mla_local_attention(q, qr, kv, pe, 2 * T, c, rank, 512, 1 / math.sqrt(576), m,  # noqa: E731
                                                     "e", "auto", lens)
    monkeypatch.setenv("DCP_REPLAY", "0")
    want = call()
    monkeypatch.setenv("DCP_REPLAY", "1")
    replay._REPLAYS.clear()
    first, again = call(), call()  # recorded, then replayed
    assert [type(v) for v in replay._REPLAYS.values()] == [replay.Replay]  # the Triton backend replays
    for got in (first, again):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q.normal_()
    lens.fill_(T)  # the replay reads the new data and counts
    monkeypatch.setenv("DCP_REPLAY", "0")
    want = call()
    monkeypatch.setenv("DCP_REPLAY", "1")
    got = call()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_cuda
@pytest.mark.gpu
def test_gpu_replay_captures_in_a_cuda_graph():
    import dcp_pass.runtime.decode.ops  # noqa: F401

    B, T = 2, 1024
    q, qr, kv, pe, _ = _op_inputs(B, 16, T, False)
    lens = torch.tensor([T], device="cuda")
    call = lambda: torch.ops.dcp.mla_local_attention(q, qr, kv, pe, T, 2, 0, 512, 0.05, None, "e", "auto", lens)  # noqa: E731
    call(), call()  # recorded and replayed outside the graph first
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        out, lse = call()
    torch.cuda.current_stream().wait_stream(s)
    for n in (T // 2, T, 3):
        lens.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = call()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("H, kernel", [(16, "gluon_fp8_narrow"), (128, "gluon_fp8")])
@pytest.mark.gpu_full
def test_gpu_fp8_replay_reads_each_layer_s_own_cache(monkeypatch, H, kernel):
    """Three layers' fp8 caches of one signature: every replayed call, eager and captured in a
    CUDA graph, equals that layer's Python path bit for bit (the narrow kernel reads the cache
    through TMA descriptors, which a replay must move to each layer's cache)."""
    import dcp_pass.runtime.decode.ops  # noqa: F401
    from dcp_pass.runtime.decode.kernels.common import recording_launches
    from dcp_pass.runtime.decode.kernels.registry import KERNELS
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack

    B, T, c, rank = 4, 2048, 2, 1
    layout = Fp8Layout(512, 64, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    caches = [pack(torch.randn(B, T, 576, device="cuda", generator=g), layout) for _ in range(3)]
    q = torch.randn(B, 1, H, 576, dtype=torch.bfloat16, device="cuda", generator=g)
    lens = torch.tensor([2 * T - 3, 5, 0, T + 1], device="cuda")

    def call(kv):
        return torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, c, rank, 512, 1 / math.sqrt(576), None,
                                                 "e", kernel, lens, kv_format=layout.spec())

    monkeypatch.setenv("DCP_REPLAY", "0")
    with recording_launches() as launches:
        want = [call(kv) for kv in caches]
    if KERNELS[kernel].module not in {launch[0].fn.__module__.split(".")[-1] for launch in launches}:
        pytest.skip(f"{kernel} does not run here (it is offered on the Triton it was timed with)")
    assert not torch.equal(want[0][0], want[1][0])  # the layers differ, so reading the wrong one shows
    monkeypatch.setenv("DCP_REPLAY", "1")
    replay._REPLAYS.clear()
    for _ in range(2):  # the first call records, every later one replays
        for kv, (o, lse) in zip(caches, want):
            got = call(kv)
            assert torch.equal(got[0], o) and torch.equal(got[1], lse)
    assert [type(v) for v in replay._REPLAYS.values()] == [replay.Replay]
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        captured = [call(kv) for kv in caches]
    torch.cuda.current_stream().wait_stream(s)
    q.normal_()
    lens.copy_(torch.tensor([T, 2 * T, 7, 3], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("DCP_REPLAY", "0")
    for kv, (o, lse) in zip(caches, captured):
        want_o, want_lse = call(kv)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.gpu_full
def test_gpu_replay_is_made_per_fp8_read(monkeypatch):
    """DCP_FP8_READ picks how the split kernel reads an fp8 tile (fold or dequant, which round
    differently): a call under one read never replays the other's recording."""
    import dcp_pass.runtime.decode.ops  # noqa: F401
    from dcp_pass.runtime.decode.kv_format import Fp8Layout, pack

    B, H, T = 2, 16, 1024
    layout = Fp8Layout(512, 64, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    kv = pack(torch.randn(B, T, 576, device="cuda", generator=g), layout)
    q = torch.randn(B, 1, H, 576, dtype=torch.bfloat16, device="cuda", generator=g)
    lens = torch.tensor([2 * T - 1, 9], device="cuda")

    def call():
        return torch.ops.dcp.mla_local_attention(q, None, kv, None, 2 * T, 2, 0, 512, 1 / math.sqrt(576), None, "e",
                                                 "split", lens, kv_format=layout.spec())

    want = {}
    monkeypatch.setenv("DCP_REPLAY", "0")
    for read in ("fold", "dequant"):
        monkeypatch.setenv("DCP_FP8_READ", read)
        want[read] = call()
    assert not torch.equal(want["fold"][0], want["dequant"][0])  # the reads differ, so a stale one shows
    monkeypatch.setenv("DCP_REPLAY", "1")
    replay._REPLAYS.clear()
    for read in ("fold", "dequant", "fold", "dequant"):  # each read records once, then replays
        monkeypatch.setenv("DCP_FP8_READ", read)
        got = call()
        assert torch.equal(got[0], want[read][0]) and torch.equal(got[1], want[read][1])
    assert [type(v) for v in replay._REPLAYS.values()] == [replay.Replay] * 2
