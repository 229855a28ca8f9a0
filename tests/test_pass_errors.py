"""Bad input gets a clear, early error; graphs the pass cannot handle run unchanged."""
import pytest
import torch

from dcp_pass.state.store import DcpCacheError
import torch.distributed as dist

from dcp_pass.backend import DcpBackend
from kit.graphs import TinyMLA, init_fake_world, tiny_inputs


@pytest.fixture
def fake_world():
    torch._dynamo.reset()
    yield init_fake_world
    torch._dynamo.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def _compile(c, **options):
    options.setdefault("inner", "eager")
    backend = DcpBackend(dcp_size=c, **options)
    return torch.compile(TinyMLA(), backend=backend), backend


@torch.no_grad()
def test_write_past_capacity_is_a_clear_error(fake_world):
    fake_world(2)
    model, _ = _compile(2)
    model(*tiny_inputs(1, 5))
    model(*tiny_inputs(1, 6))  # start_pos is symbolic from here on
    model(*tiny_inputs(1, 15))  # the last position fits
    with pytest.raises(RuntimeError, match=r"past the cache capacity"):
        model(*tiny_inputs(1, 16))


@torch.no_grad()
def test_write_past_capacity_static_start(fake_world):
    fake_world(2)
    model, _ = _compile(2)
    with pytest.raises(Exception, match="past the cache capacity|size"):
        model(*tiny_inputs(3, 15))


@torch.no_grad()
def test_invalid_topology_fails_before_compiling(fake_world):
    fake_world(4)
    model, _ = _compile(8, tp_size=4)
    with pytest.raises(Exception, match="dcp_size=8 does not fit"):
        model(*tiny_inputs(1, 5))


def test_dcp_without_process_group_says_what_to_do():
    torch._dynamo.reset()
    assert not dist.is_initialized()
    model, _ = _compile(2)
    with torch.no_grad(), pytest.raises(Exception, match="init_process_group"):
        model(*tiny_inputs(1, 5))


@torch.no_grad()
def test_explicit_comm_backend_that_cannot_run(fake_world):
    fake_world(2)
    model, _ = _compile(2, comm_backend="fi_a2a")
    with pytest.raises(Exception, match="fi_a2a"):
        model(*tiny_inputs(1, 5))


@torch.no_grad()
def test_strict_mode_turns_a_near_miss_into_an_error(fake_world):
    fake_world(2)
    backend = DcpBackend(dcp_size=2, inner="eager", strict=True)
    model = torch.compile(TinyMLA(leak_probs=True), backend=backend)
    with pytest.raises(Exception, match="near-miss MLA pattern.*used outside the value product"):
        model(*tiny_inputs(1, 5))


@torch.no_grad()
def test_near_miss_runs_unchanged_and_correct(fake_world):
    fake_world(2)
    reference = TinyMLA(leak_probs=True)
    model = TinyMLA(leak_probs=True)
    model.load_state_dict(reference.state_dict())
    backend = DcpBackend(dcp_size=2, inner="eager")
    compiled = torch.compile(model, backend=backend)
    for start in (0, 3):
        args = tiny_inputs(3, start, "additive")
        got, want = compiled(*args), reference(*args)
        torch.testing.assert_close(got, want)
    assert backend.report.layers_rewritten == 0 and backend.report.graphs[0].near_misses


@torch.no_grad()
@pytest.mark.parametrize("attn_backend, message", [("triton", "needs CUDA"), ("flashinfer", "flashinfer")])
def test_attention_backend_that_cannot_run(fake_world, attn_backend, message):
    fake_world(2)
    model, _ = _compile(2, attn_backend=attn_backend)
    with pytest.raises(Exception, match=message):
        model(*tiny_inputs(1, 5))


class IndexCopyWriteMLA(TinyMLA):
    """Writes the latent cache with index_copy_, a form the pass does not rewrite."""

    def forward(self, q_lat, q_pe, latent, k_pe, start_pos: int, mask=None):
        bsz, seqlen = q_lat.shape[:2]
        positions = torch.arange(start_pos, start_pos + seqlen)
        self.kv_cache[:bsz].index_copy_(1, positions, latent)
        self.pe_cache[:bsz, start_pos:start_pos + seqlen] = k_pe
        end = start_pos + seqlen
        scores = torch.einsum("bshc,btc->bsht", q_lat, self.kv_cache[:bsz, :end]) + torch.einsum(
            "bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end])
        probs = (scores * 0.25).softmax(dim=-1, dtype=torch.float32).type_as(q_lat)
        o = torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, :end])
        return torch.einsum("bshc,hdc->bshd", o, self.w_uv).flatten(2)


@torch.no_grad()
def test_unknown_cache_write_leaves_the_graph_unchanged_with_a_reason(fake_world):
    fake_world(2)
    reference, model = IndexCopyWriteMLA(), IndexCopyWriteMLA()
    model.load_state_dict(reference.state_dict())
    backend = DcpBackend(dcp_size=2, inner="eager")
    compiled = torch.compile(model, backend=backend)
    for start in (0, 1):
        args = tiny_inputs(1, start)
        torch.testing.assert_close(compiled(*args), reference(*args))
    summary = backend.report.summary()
    assert backend.report.layers_rewritten == 0, summary
    assert "used outside the matched attention" in summary and "index_copy_" in summary, summary
    assert model.kv_cache.untyped_storage().size() > 0  # nothing was released


def _sharded_model_declared_unsharded(rank: int, world: int) -> str:
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    model = build_model(ModelArgs(tp_size=world, n_layers=1, n_dense_layers=1), rank=rank)
    backend = DcpBackend(dcp_size=world, tp_size=1, inner="eager")
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(torch.zeros(2, 1, dtype=torch.long), 3)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e)
    return "no error"


def test_head_sharded_model_with_tp_size_1_is_refused():
    from dcp_pass.testing import run_ranks

    for message in run_ranks(_sharded_model_declared_unsharded, 2, timeout=300):
        assert "looks head-sharded; pass its tensor-parallel size as tp_size" in message, message


class SharedStorageMLA(TinyMLA):
    """Latent and rotary caches carved out of one allocation (views of one storage), which a
    pool holds too; `spare` columns of it belong to neither cache."""

    def __init__(self, spare: int = 0):
        super().__init__()
        self.pool = torch.zeros(2, 16, 8 + 4 + spare)
        del self.kv_cache, self.pe_cache
        self.register_buffer("kv_cache", self.pool[..., :8])
        self.register_buffer("pe_cache", self.pool[..., 8:12])


@torch.no_grad()
def test_caches_sharing_one_allocation_release_it_once_both_are_striped(fake_world):
    """Both caches striped hold every byte of the allocation: it is released, so the pool's
    own view fails at its next use instead of writing rows no graph reads (before: kept, and
    a write through the pool changed nothing the model saw, decode 2.35 off)."""
    fake_world(2)
    reference, model = SharedStorageMLA(), SharedStorageMLA()
    model.load_state_dict(reference.state_dict())
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    compiled(*tiny_inputs(1, 0))
    assert model.pool.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        model.pool[:, 4:8] = 1.0
    with pytest.raises(DcpCacheError, match="pe_cache"):  # striped: not to be read eagerly
        model.pe_cache.abs()


@torch.no_grad()
def test_cache_sharing_storage_with_other_data_is_kept_and_said(fake_world, caplog):
    fake_world(2)
    reference, model = SharedStorageMLA(spare=1), SharedStorageMLA(spare=1)
    model.load_state_dict(reference.state_dict())
    compiled = torch.compile(model, backend=DcpBackend(dcp_size=2, tp_size=1, inner="eager"))
    with caplog.at_level("WARNING", logger="dcp_pass"):
        compiled(*tiny_inputs(1, 0))
    assert model.pool.untyped_storage().nbytes() > 0  # its spare column lives there
    assert "does not reach this rank's shard" in caplog.text
