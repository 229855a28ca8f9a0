"""What happens to a cache buffer after DCP released its full-size storage.

Every ordinary path that would read the missing data either works or raises
`DcpCacheError` naming DCP and the buffer: deepcopy, dtype/device conversion, pickling,
state_dict save/load, calling the original module, a plain `torch.compile` of it, and
Dynamo's eager fallback at the recompile limit. None of the guards may cost a recompile.
And a deleted compiled model frees its shards.

Cases that could crash the process (a segfault on a read of released storage) run in a
child process.
"""
import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

from dcp_pass.backend import DcpBackend
from dcp_pass.state import store
from dcp_pass.state.store import DcpCacheError
from dcp_pass.testing import run_ranks
from kit.graphs import TinyMLA, init_fake_world, tiny_inputs


class Outer(nn.Module):
    """The usual structure: the cache-owning attention is a submodule."""

    def __init__(self):
        super().__init__()
        self.attn = TinyMLA()

    def forward(self, *args):
        return self.attn(*args) * 2


def _striped(model_cls=TinyMLA, steps=2):
    """`model_cls` compiled with DCP (c=2, fake world) and run `steps` decode steps."""
    model = model_cls()
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    for step in range(steps):
        compiled(*tiny_inputs(1, step))
    return model, compiled


# ----------------------------------------------------------------------------- A: released buffers


@torch.no_grad()
def test_deepcopy_of_striped_model_is_refused(fake_world):
    model, _ = _striped()
    with pytest.raises(DcpCacheError, match=r"deep-copy the cache buffer kv_cache: DCP striped it \(dcp_size=2\)"):
        copy.deepcopy(model)


@torch.no_grad()
def test_pickle_and_state_dict_of_striped_model_are_refused(fake_world):
    model, _ = _striped()  # TinyMLA's caches are persistent buffers: they are in its state_dict
    with pytest.raises(DcpCacheError, match="pickle.*kv_cache"):
        pickle.dumps(model)
    with pytest.raises(DcpCacheError, match="save \\(state_dict\\).*kv_cache"):
        torch.save(model.state_dict(), io.BytesIO())
    state = TinyMLA().state_dict()
    with pytest.raises(DcpCacheError, match="load.*kv_cache"):
        model.load_state_dict(state)


@torch.no_grad()
def test_no_op_conversions_still_work(fake_world):
    model, compiled = _striped()
    assert model.float() is model and model.to("cpu") is model  # the buffers stay what they were
    assert model.kv_cache.to(torch.float32) is model.kv_cache and model.kv_cache.type() == "torch.FloatTensor"
    compiled(*tiny_inputs(1, 2))


@torch.no_grad()
def test_calling_the_original_module_is_refused(fake_world):
    model, _ = _striped(Outer)
    with pytest.raises(DcpCacheError, match=r"TinyMLA ran eagerly.*attn.kv_cache, attn.pe_cache.*DCP striped it"):
        model(*tiny_inputs(1, 2))
    with pytest.raises(DcpCacheError, match="ran eagerly"):
        model.attn(*tiny_inputs(1, 2))


@torch.no_grad()
def test_eager_fallback_at_the_recompile_limit_is_refused(fake_world):
    model = Outer()
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    compiled(*tiny_inputs(1, 0))
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(DcpCacheError, match=r"ran eagerly.*recompile_limit"):
            compiled(*tiny_inputs(2, 1))  # a new shape: Dynamo would recompile, but may not


def _graphs(backend_factory):
    """Graphs compiled for a short prefill + decode run of `Outer` under `backend`."""
    torch._dynamo.reset()
    counted = []
    backend = backend_factory(counted)
    compiled = torch.compile(Outer(), backend=backend)
    for seqlen, start in [(3, 0), (1, 3), (1, 4), (1, 5), (2, 6)]:
        compiled(*tiny_inputs(seqlen, start))
    return len(counted)


@torch.no_grad()
def test_guards_add_no_recompile(fake_world):
    def dcp(counted):
        backend = DcpBackend(dcp_size=2, tp_size=1, inner="eager")
        return lambda gm, example: counted.append(gm) or backend(gm, example)

    plain = _graphs(lambda counted: lambda gm, example: counted.append(gm) or gm.forward)
    assert _graphs(dcp) == plain


def _crashing_path(rank, world, path):
    """Run one path that segfaulted before the guards; return the error it raises."""
    init_fake_world(2)
    with torch.no_grad():
        model, _ = _striped(Outer)
        try:
            if path == "to_float64":
                model.to(torch.float64)
            elif path == "plain_compile":
                torch.compile(model)(*tiny_inputs(1, 2))
            elif path == "aot_eager_compile":
                torch.compile(model, backend="aot_eager")(*tiny_inputs(1, 2))
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("path", ["to_float64", "plain_compile", "aot_eager_compile"])
def test_paths_that_crashed_raise_a_dcp_error(path):
    (message,) = run_ranks(_crashing_path, 1, path, timeout=300)
    assert "DcpCacheError" in message and "kv_cache" in message, message
    if path == "to_float64":
        assert "convert (.to)" in message and "DCP striped it" in message, message
    else:
        assert "only backend='dcp' can run them" in message, message


def _plain_compile_then_dcp_again(rank, world):
    """A refused plain compile does not break the DCP-compiled model."""
    init_fake_world(2)
    with torch.no_grad():
        model, compiled = _striped(Outer)
        try:
            torch.compile(model)(*tiny_inputs(1, 2))
        except Exception:  # noqa: BLE001 - refused, as test_paths_that_crashed... checks
            pass
        return compiled(*tiny_inputs(1, 2)).shape


def test_dcp_model_still_runs_after_a_refused_plain_compile():
    (shape,) = run_ranks(_plain_compile_then_dcp_again, 1, timeout=300)
    assert tuple(shape) == (2, 1, 24)


# ----------------------------------------------------------------------------- B: registry lifetime


def _cycle(inner):
    """Build, compile, decode, delete; weak references to what must die with the model."""
    model = Outer()
    backend = DcpBackend(dcp_size=2, tp_size=1, inner=inner)
    compiled = torch.compile(model, backend=backend)
    for seqlen, start in [(3, 0), (1, 3), (1, 4)]:
        compiled(*tiny_inputs(seqlen, start))
    buffers = [model.attn.kv_cache, model.attn.pe_cache]
    shards = [store.lookup_local_cache(b).local for b in buffers]
    refs = [weakref.ref(x) for x in (model, *buffers, *shards)]
    del model, compiled, backend, buffers, shards
    return refs


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@torch.no_grad()
def test_deleted_models_free_their_shards(fake_world, inner):
    refs = []
    for _ in range(5):
        refs += _cycle(inner)
        torch._dynamo.reset()  # Dynamo's code cache holds the compiled graphs, as a user would reset
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [type(x).__name__ + str(tuple(getattr(x, "shape", ()))) for x in alive]
    assert len(store.STRIPED) == 0


class _Runner:
    """A user's driver object (not a module) whose method compiles and runs the model."""

    def first_call_then_free(self, compiled):
        scratch = torch.zeros(1 << 16)  # e.g. a loaded checkpoint, dropped after the first step
        ref = weakref.ref(scratch)
        compiled(*tiny_inputs(1, 0))  # the first call installs the shards and learns their owners
        del scratch
        gc.collect()
        return ref() is None


@torch.no_grad()
def test_learning_owners_keeps_no_caller_locals_alive(fake_world):
    """Owners are learnt from the modules on the call stack. Reading a frame's locals on
    Python < 3.13 leaves a snapshot of them on the frame until it returns, so only the
    frames of nn.Module methods may be read: a driver's method must get its memory back."""
    compiled = torch.compile(Outer(), backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    assert _Runner().first_call_then_free(compiled)
    assert store.lookup_local_cache(compiled._orig_mod.attn.kv_cache) is not None


@torch.no_grad()
def test_a_graph_reading_a_striped_cache_outside_attention_names_its_line(fake_world):
    model, _ = _striped()

    def total(m):
        return m.kv_cache.sum() * 2  # a read the pass cannot stripe

    with pytest.raises(Exception, match=r"no full-size storage .* first read at test_cache_lifecycle\.py:\d+ "
                                        r"`return m\.kv_cache\.sum\(\) \* 2"):
        torch.compile(total, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))(model)
