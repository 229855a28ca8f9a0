"""Group sizes, containment rules and DCP sub-group construction (docs/usage.md, options dcp_size to attn_dp_size).

Rank layout assumed (the one of the reference serving engines):
  * TP groups are consecutive blocks of `tp_size` global ranks;
  * inside a TP group, attention-DP replicas are consecutive blocks of
    `attn_tp_size = tp_size / attn_dp_size` ranks;
  * inside an attention-TP group, DCP groups are consecutive blocks of `dcp_size`
    ranks, so `dcp_rank == attn_tp_rank % dcp_size` and the heads a DCP group
    serves are contiguous (query all-gather in DCP-rank order == head order).

When `tp_size == 1` the model is not head-sharded: every rank holds all heads and
DCP groups are blocks of `dcp_size` replicas that each hold 1/c of the cache
("head-replicated" mode, every rank ends with all heads after the merge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class DcpTopologyError(ValueError):
    """The requested (world, tp, attn_dp, dcp) sizes cannot form valid DCP groups."""


@dataclass(frozen=True)
class DcpTopology:
    world_size: int
    rank: int
    tp_size: int
    attn_dp_size: int
    dcp_size: int
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_rank: int
    dcp_rank: int
    dcp_group_ranks: tuple[int, ...]

    @property
    def head_sharded(self) -> bool:
        """True when attention heads are split over TP ranks (the usual TP model)."""
        return self.tp_size > 1

    @property
    def enabled(self) -> bool:
        return self.dcp_size > 1


def _divisors(n: int) -> str:
    """The divisors of `n`, comma-separated (the valid sizes an error message offers)."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def plan_topology(
    world_size: int, rank: int, dcp_size: int, tp_size: Optional[int] = None, attn_dp_size: int = 1
) -> DcpTopology:
    """Validate the sizes and place `rank`; pure (no process group is touched)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DcpTopologyError(f"rank {rank} is not inside a world of size {world_size}")
    tp = world_size if tp_size is None else tp_size
    if world_size % tp != 0:
        raise DcpTopologyError(
            f"tp_size={tp} does not divide the world size {world_size}; valid tp_size values: {_divisors(world_size)}"
        )
    if tp % attn_dp_size != 0:
        raise DcpTopologyError(
            f"attn_dp_size={attn_dp_size} does not divide tp_size={tp}; attention DP splits the TP group "
            f"into equal replicas (valid attn_dp_size values: {_divisors(tp)})"
        )
    attn_tp = tp // attn_dp_size
    if tp == 1:
        return _plan_head_replicated(world_size, rank, dcp_size, attn_dp_size)
    if attn_tp % dcp_size != 0:
        raise DcpTopologyError(
            f"dcp_size={dcp_size} does not fit: attn_tp_size = tp_size / attn_dp_size = {tp} / {attn_dp_size} "
            f"= {attn_tp}, and attn_tp_size % dcp_size must be 0 so that a DCP group lies inside one "
            f"attention-TP group of one attention-DP replica. Valid dcp_size values here: {_divisors(attn_tp)}"
        )
    local = rank % tp
    attn_dp_rank, attn_tp_rank = divmod(local, attn_tp)
    dcp_rank = attn_tp_rank % dcp_size
    first = rank - dcp_rank
    group = tuple(range(first, first + dcp_size))
    topo = DcpTopology(
        world_size, rank, tp, attn_dp_size, dcp_size, attn_tp, attn_tp_rank, attn_dp_rank, dcp_rank, group
    )
    check_containment(topo)
    return topo


def _plan_head_replicated(world_size: int, rank: int, dcp_size: int, attn_dp_size: int) -> DcpTopology:
    if attn_dp_size != 1:
        raise DcpTopologyError("attn_dp_size must be 1 when tp_size is 1 (an unsharded model has no attention TP)")
    if world_size % dcp_size != 0:
        raise DcpTopologyError(
            f"dcp_size={dcp_size} does not divide the world size {world_size} for an unsharded model "
            f"(tp_size=1): DCP groups are blocks of dcp_size replicas. Valid dcp_size values: "
            f"{_divisors(world_size)}"
        )
    dcp_rank = rank % dcp_size
    first = rank - dcp_rank
    return DcpTopology(world_size, rank, 1, 1, dcp_size, 1, 0, 0, dcp_rank, tuple(range(first, first + dcp_size)))


def check_containment(topo: DcpTopology) -> None:
    """Every member of the DCP group shares the attention-TP group and DP replica, in merge order."""
    tp, attn_tp = topo.tp_size, topo.attn_tp_size
    replica = topo.rank // tp, (topo.rank % tp) // attn_tp
    for pos, member in enumerate(topo.dcp_group_ranks):
        member_replica = member // tp, (member % tp) // attn_tp
        if member_replica != replica:
            raise DcpTopologyError(
                f"DCP group {list(topo.dcp_group_ranks)} crosses an attention replica boundary at rank {member}"
            )
        if (member % tp) % attn_tp % topo.dcp_size != pos:
            raise DcpTopologyError(
                f"rank {member} sits at DCP position {pos} but its attn_tp_rank % dcp_size is "
                f"{(member % tp) % attn_tp % topo.dcp_size}; the merge order must follow attn_tp_rank"
            )


def all_dcp_groups(topo: DcpTopology) -> list[tuple[int, ...]]:
    """Every DCP group of the world, in the order all ranks must create them."""
    c = topo.dcp_size
    return [tuple(range(first, first + c)) for first in range(0, topo.world_size, c)]


# (world size, c, backend, rank) -> (the default group it was made under, this rank's DCP group)
_GROUP_CACHE: dict[tuple, tuple] = {}


def dcp_process_group(topo: DcpTopology):
    """The ProcessGroup of this rank's DCP group (created once, collectively, then cached).

    Cached per default process group: after ``destroy_process_group`` and a new
    ``init_process_group`` (a restart in the same process) the old groups are gone and
    their names may point at groups made since, so the groups are made again."""
    import torch.distributed as dist

    if topo.dcp_size == topo.world_size:
        return dist.group.WORLD
    key = (topo.world_size, topo.dcp_size, dist.get_backend(), topo.rank)
    world = dist.group.WORLD
    held = _GROUP_CACHE.get(key)
    if held is None or held[0] is not world:
        # new_group must be called by every rank for every group, in the same order.
        groups = [dist.new_group(list(ranks)) for ranks in all_dcp_groups(topo)]
        _GROUP_CACHE[key] = held = (world, groups[topo.rank // topo.dcp_size])
    return held[1]


def check_explicit_group(topo: DcpTopology, group) -> None:
    """An explicit `group=` option must be exactly this rank's DCP group in merge order."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks != topo.dcp_group_ranks:
        raise DcpTopologyError(
            f"the process group given in options has ranks {list(ranks)}, but with tp_size={topo.tp_size}, "
            f"attn_dp_size={topo.attn_dp_size}, dcp_size={topo.dcp_size} rank {topo.rank} belongs to DCP group "
            f"{list(topo.dcp_group_ranks)} (dcp_rank == attn_tp_rank % dcp_size); pass that group or none"
        )


def topology_from_world(dcp_size: int, tp_size: Optional[int], attn_dp_size: int) -> DcpTopology:
    """Plan the topology of this process from the initialized default process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if dcp_size == 1:
            return plan_topology(1, 0, 1, 1 if tp_size is None else tp_size, attn_dp_size)
        raise DcpTopologyError(
            f"dcp_size={dcp_size} needs an initialized torch.distributed process group "
            f"(run under torchrun and call torch.distributed.init_process_group first)"
        )
    return plan_topology(dist.get_world_size(), dist.get_rank(), dcp_size, tp_size, attn_dp_size)
