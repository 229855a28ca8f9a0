"""DCP collectives on real multi-process gloo groups, and backend resolution.

Spawning ranks is the expensive part (each imports torch), so each group size runs
ONE spawn that performs every check and returns numbers; the individual tests below
only assert on those numbers. Every rank draws the same global data from a shared
seed, so each can compute the expected answer with a single-process merge.
"""
from __future__ import annotations

import math

import pytest
import torch

from dcp_pass.runtime.decode.comm import (
    COMM_BACKENDS,
    CommBackendUnavailable,
    exchange_fi_a2a,
    resolve_comm_backend,
)
from dcp_pass.runtime.decode.merge import merge_partials

SEED = 1234
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- rank side


def _global_partials(c: int, dtype=torch.float32):
    """Partials of every KV shard for every head, shared by all ranks (same seed)."""
    g = torch.Generator().manual_seed(SEED + c)
    B, S, Hl, D = 3, 2, 2, 24
    Hg = c * Hl
    O = torch.randn(c, B, S, Hg, D, generator=g)
    L = torch.randn(c, B, S, Hg, generator=g) * 4
    # Empty shards (LSE -inf, the only spelling of "no visible key"); their outputs are
    # garbage that must not leak.
    L[1, 0, 0, :] = NEG_INF  # shard 1 saw no keys for (b=0, s=0)
    O[1, 0, 0, :] = float("nan")
    L[c - 1, 2, 0, 1] = NEG_INF
    L[:, 2, 1, Hg - 1] = NEG_INF  # a row empty on every rank
    return O.to(dtype), L, Hl


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def _local_attention(q, k, v, keep, scale):
    """Attention of q [B,S,H,Dk] over k/v [B,L,*] restricted to keep [B,L]; fp32.

    Returns (o [B,S,H,Dv], lse [B,S,H]); rows with no kept key give lse -inf and a
    NaN output, like a naive kernel would.
    """
    s = torch.einsum("bshd,bld->bshl", q, k) * scale
    s = s.masked_fill(~keep[:, None, None, :], NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bshl,bld->bshd", p, v), lse


def _dcp_decode_case(rank: int, c: int, group_name: str, dev: str):
    """A whole DCP decode step: gather Q heads, local attention on this rank's stripe,
    packed all-to-all + merge; compared with float64 full attention."""
    from dcp_pass.runtime.decode.comm import exchange_a2a, gather_heads

    g = torch.Generator().manual_seed(SEED * 7 + c)
    B, S, Hl, Dk, Dv, Lmax = 3, 1, 2, 16, 12, 13
    Hg = c * Hl
    q = torch.randn(B, S, Hg, Dk, generator=g)
    kv = torch.randn(B, Lmax, Dk, generator=g)  # MLA style: one latent row per token
    k, v = kv, kv[..., :Dv]
    lens = torch.tensor([c - 1, 7, Lmax])  # batch 0: the last rank owns no token
    pos = torch.arange(Lmax)
    valid = pos[None, :] < lens[:, None]
    scale = Dk ** -0.5

    q_local = q[:, :, rank * Hl:(rank + 1) * Hl].to(dev)
    q_all = gather_heads(q_local, group_name, c)
    owned = valid & (pos % c == rank)[None, :]  # striped layout: p mod c == rank
    o_r, lse_r = _local_attention(q_all, k.to(dev), v.to(dev), owned.to(dev), scale)
    out = exchange_a2a(o_r, lse_r, group_name, c).cpu()
    q_all = q_all.cpu()

    ref, _ = _local_attention(q.double(), k.double(), v.double(), valid, scale)
    return {
        "gathered_q_exact": torch.equal(q_all, q),
        "decode_err": _maxdiff(out, ref[:, :, rank * Hl:(rank + 1) * Hl]),
        "decode_shape": tuple(out.shape),
    }


def _compile_case(rank: int, c: int, group_name: str, O, L, Hl):
    """exchange_a2a under torch.compile(aot_eager) and its traced op counts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_pass.runtime.decode.comm import exchange_a2a

    def step(o, lse):
        return exchange_a2a(o, lse, group_name, c)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(O[rank], L[rank])
    eager = step(O[rank], L[rank])
    # The op-level graph aot_autograd sees; fake mode traces shapes only, so no
    # collective actually runs here.
    gm = make_fx(step, tracing_mode="fake")(O[rank], L[rank])
    f = torch.ops._c10d_functional
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "compiled_vs_eager": _maxdiff(got, eager),
        "n_all_to_all": sum(t == f.all_to_all_single.default for t in targets),
        "n_wait": sum(t == f.wait_tensor.default for t in targets),
        "n_other_collectives": sum(
            t in (f.all_gather_into_tensor.default, f.reduce_scatter_tensor.default, f.all_reduce.default)
            for t in targets
        ),
    }


def _rank_main(rank: int, world_size: int, do_compile: bool, dev: str = "cpu"):
    import torch.distributed as dist

    from dcp_pass.runtime.decode.comm import (
        device_comm_facts,
        exchange_a2a,
        exchange_ag_rs,
        exchange_replicated,
        gather_heads,
        select_comm_backend,
    )

    c = world_size
    gn = dist.group.WORLD.group_name
    res = {}

    O, L, Hl = _global_partials(c)
    mine = slice(rank * Hl, (rank + 1) * Hl)
    full = merge_partials(O, L)  # single-process merge of all shards
    if dev != "cpu":
        torch.cuda.set_device(rank)
    o, lse = O[rank].to(dev), L[rank].to(dev)
    sharded = {
        "a2a": exchange_a2a(o, lse, gn, c),
        "ag_rs": exchange_ag_rs(o, lse, gn, c),
    }
    for name, out in sharded.items():
        res[f"{name}_err"] = _maxdiff(out, full[..., mine, :])
        res[f"{name}_shape"] = tuple(out.shape)
        res[f"{name}_finite"] = bool(torch.isfinite(out).all())
        res[f"{name}_device"] = out.device.type
    replicated = {m: exchange_replicated(o, lse, gn, c, method=m) for m in ("a2a", "ag_rs")}
    for method, out in replicated.items():
        res[f"repl_{method}_err"] = _maxdiff(out, full)
        res[f"repl_{method}_finite"] = bool(torch.isfinite(out).all())
    # The row empty on every rank (head Hg-1, owned by the last rank) must be exactly 0.
    outs = [out.cpu() for out in replicated.values()]
    if rank == c - 1:
        outs += [sharded["a2a"].cpu(), sharded["ag_rs"].cpu()]
    res["empty_row_zero"] = all(bool((t[2, 1, -1] == 0).all()) for t in outs)

    # return_lse: the merged LSE of the heads each exchange leaves on this rank (a2a and ag_rs
    # reach it differently: a local merge of the received chunks, the rank's chunk of all heads)
    full_lse = merge_partials(O, L, return_lse=True)[1]
    with_lse = {
        "a2a": (exchange_a2a(o, lse, gn, c, return_lse=True), mine),
        "ag_rs": (exchange_ag_rs(o, lse, gn, c, return_lse=True), mine),
        "repl_a2a": (exchange_replicated(o, lse, gn, c, method="a2a", return_lse=True), slice(None)),
        "repl_ag_rs": (exchange_replicated(o, lse, gn, c, method="ag_rs", return_lse=True), slice(None)),
    }
    for name, ((out, merged_lse), heads) in with_lse.items():
        expect = full_lse[..., heads]
        same_empty = torch.equal(merged_lse == NEG_INF, expect == NEG_INF)
        finite = expect != NEG_INF
        res[f"{name}_lse_err"] = _maxdiff(merged_lse[finite], expect[finite]) if same_empty else float("inf")
        res[f"{name}_lse_out_err"] = _maxdiff(out, full[..., heads, :])

    # Base 2 partials (FlashInfer style) through both sharded paths.
    L2 = L * math.log2(math.e)
    l2 = L2[rank].to(dev)
    res["a2a_base2_err"] = _maxdiff(exchange_a2a(o, l2, gn, c, base="2"), full[..., mine, :])
    res["ag_rs_base2_err"] = _maxdiff(exchange_ag_rs(o, l2, gn, c, base="2"), full[..., mine, :])

    # bf16 partials: the packed buffer carries the LSE in two bf16 columns.
    Ob = O.bfloat16()
    full_b = merge_partials(Ob, L)
    for name, fn in (("a2a", exchange_a2a), ("ag_rs", exchange_ag_rs)):
        out = fn(Ob[rank].to(dev), lse, gn, c)
        res[f"{name}_bf16_dtype"] = str(out.dtype)
        res[f"{name}_bf16_err"] = _maxdiff(out, full_b[..., mine, :])
    out = exchange_replicated(Ob[rank].to(dev), lse, gn, c, method="a2a", out_dtype=torch.float32)
    res["repl_a2a_bf16_to_fp32_err"] = _maxdiff(out, merge_partials(Ob, L, out_dtype=torch.float32))

    # gather_heads: rank j's heads must land j-th.
    x = torch.arange(2 * 3 * Hl * 5, dtype=torch.float32).reshape(2, 3, Hl, 5) + 1000 * rank
    gathered = gather_heads(x.to(dev), gn, c).cpu()
    expect = torch.cat([x - 1000 * rank + 1000 * j for j in range(c)], dim=2)
    res["gather_heads_ok"] = torch.equal(gathered, expect)

    res.update(_dcp_decode_case(rank, c, gn, dev))
    if do_compile:
        res.update(_compile_case(rank, c, gn, O, L, Hl))

    res["facts"] = device_comm_facts(torch.device(dev, rank) if dev != "cpu" else dev, dist.group.WORLD)
    res["selected"] = select_comm_backend(None, dev, gn)
    return res


# ----------------------------------------------------------------------------- parent side

_CACHE: dict = {}


def _results(c: int):
    if c not in _CACHE:
        from dcp_pass.testing import run_ranks

        _CACHE[c] = run_ranks(_rank_main, c, c == 2, backend="gloo", timeout=240)
    return _CACHE[c]


FP32_TOL = 4e-6  # a few fp32 ulps of outputs up to ~4 in magnitude (ag_rs sums in another order)
BF16_TOL = 1.6e-2  # one bf16 ulp near 1, plus a different summation order

WORLD_SIZES = [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
@pytest.mark.parametrize("name", ["a2a", "ag_rs", "repl_a2a", "repl_ag_rs", "a2a_base2", "ag_rs_base2"])
def test_exchange_matches_single_process_merge(c, name):
    for rank, r in enumerate(_results(c)):
        assert r[f"{name}_err"] <= FP32_TOL, (rank, r[f"{name}_err"])


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
@pytest.mark.parametrize("name", ["a2a", "ag_rs", "repl_a2a", "repl_ag_rs"])
def test_exchange_returns_the_merged_lse_of_its_heads(c, name):
    """return_lse (what a sink after the merge reads): the merged LSE of the heads the rank
    holds, -inf exactly where a row is empty on every rank, and the same output as without."""
    for rank, r in enumerate(_results(c)):
        assert r[f"{name}_lse_err"] <= FP32_TOL, (rank, r[f"{name}_lse_err"])
        assert r[f"{name}_lse_out_err"] <= FP32_TOL, (rank, r[f"{name}_lse_out_err"])


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
def test_exchange_shapes_and_empty_shards(c):
    for rank, r in enumerate(_results(c)):
        assert r["a2a_shape"] == r["ag_rs_shape"] == (3, 2, 2, 24)
        for name in ("a2a", "ag_rs", "repl_a2a", "repl_ag_rs"):
            assert r[f"{name}_finite"], (rank, name)
        assert r["empty_row_zero"], rank


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
def test_exchange_bf16(c):
    for rank, r in enumerate(_results(c)):
        assert r["a2a_bf16_dtype"] == r["ag_rs_bf16_dtype"] == "torch.bfloat16"
        assert r["a2a_bf16_err"] <= BF16_TOL, (rank, r["a2a_bf16_err"])
        assert r["ag_rs_bf16_err"] <= BF16_TOL, (rank, r["ag_rs_bf16_err"])
        assert r["repl_a2a_bf16_to_fp32_err"] <= FP32_TOL, rank


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
def test_gather_heads_order(c):
    assert all(r["gather_heads_ok"] for r in _results(c))


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
def test_dcp_decode_gathered_q_matches_float64_attention(c):
    for rank, r in enumerate(_results(c)):
        assert r["gathered_q_exact"], rank
        assert r["decode_shape"] == (3, 1, 2, 12)
        assert r["decode_err"] < 1e-5, (rank, r["decode_err"])


@pytest.mark.slow
def test_exchange_a2a_compiles_to_one_all_to_all():
    for rank, r in enumerate(_results(2)):
        assert r["compiled_vs_eager"] <= FP32_TOL, rank
        assert r["n_all_to_all"] == 1, r
        assert r["n_wait"] == 1, r
        assert r["n_other_collectives"] == 0, r


@pytest.mark.slow
@pytest.mark.parametrize("c", WORLD_SIZES)
def test_device_comm_facts_on_gloo_cpu(c):
    for r in _results(c):
        f = r["facts"]
        assert f["device_type"] == "cpu" and f["group_backend"] == "gloo"
        assert f["has_all_to_all"] and not f["is_blackwell"] and not f["mnnvl_single_domain"]
        assert f["compute_capability"] is None
        assert r["selected"] == "a2a"


# ----------------------------------------------------------------------------- resolution

# (requested, device_type, is_blackwell, mnnvl_single_domain, has_all_to_all, flashinfer) -> result
# A result that is a tuple ("error", words...) means ValueError mentioning every word.
_PLATFORMS = {
    "blackwell_mnnvl_fi": dict(device_type="cuda", is_blackwell=True, mnnvl_single_domain=True,
                               has_all_to_all=True, flashinfer_available=True),
    "blackwell_mnnvl_no_fi": dict(device_type="cuda", is_blackwell=True, mnnvl_single_domain=True,
                                  has_all_to_all=True, flashinfer_available=False),
    "blackwell_two_domains": dict(device_type="cuda", is_blackwell=True, mnnvl_single_domain=False,
                                  has_all_to_all=True, flashinfer_available=True),
    "hopper": dict(device_type="cuda", is_blackwell=False, mnnvl_single_domain=False,
                   has_all_to_all=True, flashinfer_available=True),
    "rocm": dict(device_type="cuda", is_blackwell=False, mnnvl_single_domain=False,
                 has_all_to_all=True, flashinfer_available=False),
    "cpu_gloo": dict(device_type="cpu", is_blackwell=False, mnnvl_single_domain=False,
                     has_all_to_all=True, flashinfer_available=False),
    "cpu_no_a2a": dict(device_type="cpu", is_blackwell=False, mnnvl_single_domain=False,
                       has_all_to_all=False, flashinfer_available=False),
    "xpu_no_a2a": dict(device_type="xpu", is_blackwell=False, mnnvl_single_domain=False,
                       has_all_to_all=False, flashinfer_available=False),
}

_TABLE = [
    # defaults
    ("blackwell_mnnvl_fi", None, "fi_a2a"),
    ("blackwell_mnnvl_no_fi", None, "a2a"),
    ("blackwell_two_domains", None, "a2a"),
    ("hopper", None, "a2a"),
    ("rocm", None, "a2a"),
    ("cpu_gloo", None, "a2a"),
    ("cpu_no_a2a", None, "ag_rs"),
    ("xpu_no_a2a", None, "ag_rs"),
    # explicit requests that can run
    ("blackwell_mnnvl_fi", "a2a", "a2a"),
    ("blackwell_mnnvl_fi", "ag_rs", "ag_rs"),
    ("blackwell_mnnvl_fi", "fi_a2a", "fi_a2a"),
    ("hopper", "ag_rs", "ag_rs"),
    ("cpu_gloo", "ag_rs", "ag_rs"),
    ("cpu_no_a2a", "ag_rs", "ag_rs"),
    # explicit requests that cannot
    ("hopper", "fi_a2a", ("error", "fi_a2a", "Blackwell", "MNNVL")),
    ("blackwell_two_domains", "fi_a2a", ("error", "MNNVL domain")),
    ("blackwell_mnnvl_no_fi", "fi_a2a", ("error", "flashinfer")),
    ("cpu_gloo", "fi_a2a", ("error", "CUDA")),
    ("cpu_no_a2a", "a2a", ("error", "all_to_all", "ag_rs")),
    ("xpu_no_a2a", "a2a", ("error", "all_to_all")),
    # unknown names
    ("hopper", "nccl", ("error", "unknown", "'a2a'", "'ag_rs'", "'fi_a2a'")),
    ("cpu_gloo", "A2A", ("error", "unknown", "'a2a'")),
    ("cpu_gloo", "", ("error", "unknown")),
]


@pytest.mark.parametrize("platform,requested,expected", _TABLE)
def test_resolve_comm_backend(platform, requested, expected):
    facts = _PLATFORMS[platform]
    if isinstance(expected, tuple):
        with pytest.raises(ValueError) as ei:
            resolve_comm_backend(requested, **facts)
        for word in expected[1:]:
            assert word in str(ei.value), (word, str(ei.value))
    else:
        assert resolve_comm_backend(requested, **facts) == expected
        assert expected in COMM_BACKENDS


def test_resolve_comm_backend_is_keyword_only():
    with pytest.raises(TypeError):
        resolve_comm_backend(None, "cuda", True, True, True, True)  # type: ignore[misc]


def test_fi_a2a_unavailable_here_says_why():
    o = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 4)
    with pytest.raises(CommBackendUnavailable) as ei:
        exchange_fi_a2a(o, lse, "unused", 2)
    msg = str(ei.value)
    assert "fi_a2a" in msg and "CUDA" in msg and "'a2a'" in msg and "'ag_rs'" in msg


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_exchanges_on_nccl():
    """The same checks on NCCL; on CUDA the merges run the Triton kernels."""
    from dcp_pass.testing import run_ranks

    for rank, r in enumerate(run_ranks(_rank_main, 2, False, "cuda", backend="nccl", timeout=300)):
        for name in ("a2a", "ag_rs", "repl_a2a", "repl_ag_rs", "a2a_base2", "ag_rs_base2"):
            assert r[f"{name}_err"] <= FP32_TOL, (rank, name, r[f"{name}_err"])
        assert r["a2a_device"] == r["ag_rs_device"] == "cuda"
        assert r["a2a_bf16_err"] <= BF16_TOL and r["ag_rs_bf16_err"] <= BF16_TOL, r
        assert r["repl_a2a_bf16_to_fp32_err"] <= FP32_TOL, r
        assert r["empty_row_zero"] and r["gather_heads_ok"] and r["gathered_q_exact"], r
        assert r["decode_err"] < 1e-5, r
        f = r["facts"]
        assert f["device_type"] == "cuda" and f["group_backend"] == "nccl" and f["has_all_to_all"], f
        assert r["selected"] == ("fi_a2a" if f["mnnvl_single_domain"] and f["flashinfer_available"] else "a2a")


def test_fi_a2a_workspace_is_made_again_for_a_new_group_of_the_same_name(monkeypatch):
    """The MNNVL workspace is cached by group name; a name is reused once the default group is
    destroyed and made again, so the workspace is kept with the group object it was made for
    and made anew for another (FlashInfer itself stubbed: no Blackwell machine here; the stub
    records each workspace's rank and group)."""
    import sys
    import types

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_pass.runtime.decode import comm

    made = []
    fic = types.ModuleType("flashinfer.comm")
    fic.Mapping = lambda **kw: kw
    fic.decode_cp_a2a_allocate_mnnvl_workspace = lambda mapping, mnnvl_config: made.append(
        (mapping["rank"], mnnvl_config)) or len(made)
    fic.decode_cp_a2a_init_workspace = lambda ws, rank, c: None
    mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
    mnnvl.MnnvlConfig = lambda comm_backend: comm_backend
    mnnvl.TorchDistBackend = lambda group: group
    fic.mnnvl = mnnvl
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.comm", fic)
    monkeypatch.setitem(sys.modules, "flashinfer.comm.mnnvl", mnnvl)
    monkeypatch.setattr(comm, "_FI_WORKSPACES", {})
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    got = []
    try:
        for rank in (0, 1):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
            name = dist.group.WORLD.group_name
            first = comm._fi_workspace(name, 2, torch.device("cpu"))
            assert comm._fi_workspace(name, 2, torch.device("cpu")) == first  # cached
            got.append((name, first))
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert got[0][0] == got[1][0], "the test needs the name reused"
    assert [ws for _, ws in got] == [(1, 0), (2, 1)], got  # one workspace each, with the new rank
    assert made[0][1] is not made[1][1]
