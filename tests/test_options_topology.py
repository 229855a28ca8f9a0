"""Options validation and topology rules (docs/usage.md, the options)."""
import pytest

from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.topology import DcpTopologyError, all_dcp_groups, plan_topology


def test_defaults_and_values():
    assert DcpOptions.from_mapping(None).dcp_size == 1
    opts = DcpOptions.from_mapping({"dcp_size": 4, "lse_base": 2, "inner": "eager"})
    assert (opts.dcp_size, opts.lse_base, opts.inner) == (4, "2", "eager")


@pytest.mark.parametrize("options, key", [
    ({"dcp_sise": 2}, "dcp_sise"),
    ({"dcp_size": "2"}, "dcp_size"),
    ({"dcp_size": True}, "dcp_size"),
    ({"dcp_size": 0}, "dcp_size"),
    ({"comm_backend": "nccl"}, "comm_backend"),
    ({"attn_backend": "cuda"}, "attn_backend"),
    ({"inner": "tvm"}, "inner"),
    ({"replicate_q_proj": "yes"}, "replicate_q_proj"),
    ({"lse_base": 10}, "lse_base"),
    ({"group": "world"}, "group"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(DcpOptionError, match=key):
        DcpOptions.from_mapping(options)


AUTOMATIC = ("comm_backend", "replicate_q_proj", "static_positions", "complex_as_real", "lse_base",
             "attn_backend", "cudagraphs")


@pytest.mark.parametrize("key", AUTOMATIC)
def test_auto_means_the_default(key):
    default = DcpOptions()
    assert DcpOptions.from_mapping({key: "auto"}) == default
    assert DcpOptions(**{key: "auto"}) == default
    if getattr(default, key) is None:  # stored as None: every reader sees the default
        assert getattr(DcpOptions.from_mapping({key: "auto"}), key) is None
        assert DcpOptions.from_mapping({key: None}) == default


@pytest.mark.parametrize("key, bad", [
    ("comm_backend", "nccl"), ("replicate_q_proj", "yes"), ("static_positions", 1), ("complex_as_real", "on"),
    ("lse_base", 10), ("attn_backend", "cuda"), ("cudagraphs", "on"),
])
def test_bad_automatic_option_names_key_and_auto(key, bad):
    with pytest.raises(DcpOptionError, match=rf"option '{key}'.*'auto'") as caught:
        DcpOptions.from_mapping({key: bad})
    assert repr(bad) in str(caught.value)


@pytest.mark.parametrize("key", ["decode_context_parallel_size", "dcp", "tp", "cuda_graphs", "dcp_comm_backend"])
def test_other_spellings_are_unknown(key):
    # one name per option: another engine's spelling is refused like any typo, naming the valid keys
    with pytest.raises(DcpOptionError, match=rf"unknown dcp option '{key}'.*dcp_size"):
        DcpOptions.from_mapping({key: 2})


@pytest.mark.parametrize("spelling", ["base2", "base_e", "base-2"])
def test_lse_base_takes_e_or_2(spelling):
    with pytest.raises(DcpOptionError, match="'lse_base'"):
        DcpOptions.from_mapping({"lse_base": spelling})


def test_spec_example_tp64_dp4():
    ok = plan_topology(64, 37, dcp_size=16, tp_size=64, attn_dp_size=4)
    assert ok.attn_tp_size == 16 and ok.attn_tp_rank == 5 and ok.dcp_rank == 5
    assert ok.dcp_group_ranks == tuple(range(32, 48))
    with pytest.raises(DcpTopologyError, match=r"attn_tp_size .* = 16.*Valid dcp_size values here: 1, 2, 4, 8, 16"):
        plan_topology(64, 0, dcp_size=32, tp_size=64, attn_dp_size=4)


@pytest.mark.parametrize("world, tp, dp, c", [(8, 8, 1, 8), (8, 8, 2, 4), (8, 4, 1, 2), (16, 8, 2, 2), (4, 4, 1, 1)])
def test_groups_are_contained_and_ordered(world, tp, dp, c):
    attn_tp = tp // dp
    for rank in range(world):
        topo = plan_topology(world, rank, c, tp, dp)
        assert topo.dcp_rank == (rank % tp) % attn_tp % c
        assert topo.dcp_group_ranks[topo.dcp_rank] == rank
        replicas = {(m // tp, (m % tp) // attn_tp) for m in topo.dcp_group_ranks}
        assert len(replicas) == 1  # one attention-TP group of one DP replica
    groups = all_dcp_groups(plan_topology(world, 0, c, tp, dp))
    assert sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("world, tp, dp, c, message", [
    (8, 3, 1, 1, "tp_size=3 does not divide the world size 8"),
    (8, 8, 3, 1, "attn_dp_size=3 does not divide tp_size=8"),
    (8, 8, 2, 8, "dcp_size=8 does not fit"),
    (6, 1, 1, 4, "dcp_size=4 does not divide the world size 6"),
    (4, 1, 2, 2, "attn_dp_size=2 does not divide tp_size=1"),
])
def test_invalid_topologies(world, tp, dp, c, message):
    with pytest.raises(DcpTopologyError, match=message):
        plan_topology(world, 0, c, tp, dp)


def test_unsharded_model_is_head_replicated_and_dcp1_is_noop():
    topo = plan_topology(4, 3, dcp_size=2, tp_size=1)
    assert not topo.head_sharded and topo.dcp_group_ranks == (2, 3) and topo.dcp_rank == 1
    one = plan_topology(4, 2, dcp_size=1, tp_size=4)
    assert not one.enabled and one.dcp_group_ranks == (2,)


def test_dcp_group_is_made_again_under_a_new_default_group():
    """A process that destroys its default group and starts another (a restart, here as
    another rank) gets the DCP group of the new one: the cached group of the old one is gone,
    and its name may point at a group made since (it did, before the cache held the default
    group it was made under)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_pass.topology import dcp_process_group, topology_from_world

    seen = []
    try:
        for rank in (0, 2):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
            dist.new_group([0, 1, 2, 3])  # a group of the user's, made first
            topo = topology_from_world(2, 4, 1)
            group = dcp_process_group(topo)
            assert dcp_process_group(topo) is group  # cached within one default group
            seen.append((tuple(dist.get_process_group_ranks(group)), topo.dcp_group_ranks))
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == [((0, 1), (0, 1)), ((2, 3), (2, 3))], seen
