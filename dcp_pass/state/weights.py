"""The weight store: other DCP ranks' shards of the weights the rewritten graphs compute their
heads with (options replicate_q_proj, project_before_merge), and stamps of the weights they
take as the same on every rank.

A graph takes those shards as trailing inputs, looked up per call from the weight tensor
actually passed (one compiled graph can serve several layers). The store is keyed weakly by
the weight: a dead model's gathered shards go with it. A weight changed after the gather
raises :class:`DcpWeightsError`; :func:`refresh_weights` gathers again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class ExtraInput:
    """A trailing graph input whose value is derived, per call, from an existing input: entry
    `rank` of what `shards` gives for it (the inputs derived from one weight share one call)."""

    index: int  # the existing input it is derived from
    shards: Callable[[torch.Tensor], list[torch.Tensor]]
    rank: int
    example: torch.Tensor


def resolve_inputs(extra: list[ExtraInput], args) -> list[torch.Tensor]:
    """The values of `extra` for one call with inputs `args`: each weight's shards looked up
    (and checked) once, whatever the number of ranks."""
    found: dict[int, list[torch.Tensor]] = {}
    values = []
    for item in extra:
        shards = found.get(item.index)
        if shards is None:
            shards = found[item.index] = item.shards(args[item.index])
        values.append(shards[item.rank])
    return values


class DcpWeightsError(RuntimeError):
    """A weight whose other ranks' shards this rank holds changed after they were gathered."""


def _version(weight: torch.Tensor) -> Optional[int]:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


@dataclass
class _Stamp:
    """What a weight was when the pass last read its values: its version counter (None: an
    inference tensor has none) and its storage's address. Renewed in place."""

    version: Optional[int]
    data_ptr: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> "_Stamp":
        return cls(_version(weight), weight.data_ptr())

    def matches(self, weight: torch.Tensor) -> bool:
        return self.data_ptr == weight.data_ptr() and self.version == _version(weight)

    def renew(self, weight: torch.Tensor) -> None:
        self.version, self.data_ptr = _version(weight), weight.data_ptr()


@dataclass
class _Held:
    """Every DCP rank's shard of one weight, and the weight's stamp when they were gathered."""

    shards: list[torch.Tensor]
    stamp: _Stamp


# weight -> {(group name, c): _Held}; weak, so a dead model's gathered weights go with it
_GATHERED = WeakIdKeyDictionary()
# weight -> {(group name, c): _Stamp} of the weights found the same on every rank that a graph
# uses for the other ranks' heads
_SAME = WeakIdKeyDictionary()


class _Recent:
    """`table`'s entry under `key` for a weight, remembered per weight (by id, confirmed by a
    weak reference): the per-call lookups cost a plain dictionary's, not a weak-key one's. The
    entries are renewed in place, so a remembered one stays current.

    Both the weight and its entry are held weakly: Dynamo keeps every compiled function (and
    so this lookup) after ``torch._dynamo.reset()``, and a strong hold here would keep a dead
    model's gathered shards alive with it. A remembered entry that the table replaced is
    looked up again."""

    def __init__(self, table: WeakIdKeyDictionary, key: tuple):
        self.table, self.key = table, key
        self.seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def __call__(self, weight: torch.Tensor):
        hit = self.seen.get(id(weight))
        if hit is not None and hit[0]() is weight:
            entry = hit[1]()
            if entry is not None:
                return entry
        entry = self.table.get(weight, {}).get(self.key)
        if entry is not None:
            self.seen[id(weight)] = (weakref.ref(weight, self._forget(id(weight))), weakref.ref(entry))
        return entry

    def _forget(self, ident: int) -> Callable[[weakref.ref], None]:
        lookup = weakref.ref(self)  # the callback must not keep this lookup alive either

        def forget(ref: weakref.ref) -> None:
            recent = lookup()
            if recent is not None and ident in recent.seen and recent.seen[ident][0] is ref:
                del recent.seen[ident]

        return forget


@dataclass
class WeightCheck:
    """A parameter input the rewritten graph uses for every rank's heads (it was the same on
    every rank when compiled): `check`, given the parameter passed, raises if it changed."""

    index: int
    check: Callable[[torch.Tensor], None]


def remember_same(weight: torch.Tensor, group_name: str, c: int) -> None:
    table = _SAME.setdefault(weight, {})
    stamp = table.get((group_name, c))
    if stamp is None:
        table[(group_name, c)] = _Stamp.of(weight)
    else:
        stamp.renew(weight)
    _GATHERED.get(weight, {}).pop((group_name, c), None)  # a graph compiled before the weight changed


def check_same_unchanged(
    weight: torch.Tensor, group_name: str, c: int, name: str, stamp: Optional[_Stamp] = None
) -> None:
    """DcpWeightsError when `weight`, which the graph takes as the same on every rank, was
    written in place or given new storage since that was checked (`stamp`: its entry, when
    the caller has it)."""
    if stamp is None:
        stamp = _SAME.get(weight, {}).get((group_name, c))
    if stamp is not None and not stamp.matches(weight):
        raise DcpWeightsError(
            f"{name} was the same on every DCP rank when the graph was compiled, and the graph computes the "
            f"other ranks' heads with this rank's copy of it; it changed since (written in place or given new "
            f"storage): call dcp_pass.refresh_weights(model) on every rank after updating the weights, which "
            f"checks that it is still the same on every rank"
        )


def _gather(weight: torch.Tensor, group_name: str, c: int) -> list[torch.Tensor]:
    """Every DCP rank's shard of `weight` (an eager all-gather; collective over the group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    group = _resolve_process_group(GroupName(group_name))
    local = weight.detach().contiguous()
    if dist.get_backend(group) == "gloo":
        # gloo lacks half-precision (and int16) all-gathers: move the raw bytes instead
        raw = local.reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(c)]
        dist.all_gather(parts, raw, group=group)
        parts = [p.view(local.dtype).view(local.shape) for p in parts]
    else:
        parts = [torch.empty_like(local) for _ in range(c)]
        dist.all_gather(parts, local, group=group)
    # this rank's own shard is the weight itself: no second copy of it is kept
    own = dist.get_rank(group)
    parts[own] = weight.detach()
    held = _GATHERED.get(weight, {}).get((group_name, c))
    if held is not None and all(h.shape == p.shape and h.dtype == p.dtype for h, p in zip(held.shards, parts)):
        # gathered again: into the copies the graphs already take, whose addresses CUDA graphs
        # captured (the graphs' inputs are static)
        with torch.inference_mode():  # the copies may be inference tensors (made under it)
            for r, (h, p) in enumerate(zip(held.shards, parts)):
                if r != own:
                    h.copy_(p)
        held.shards[own] = parts[own]
        held.stamp.renew(weight)
    else:
        _GATHERED.setdefault(weight, {})[(group_name, c)] = held = _Held(parts, _Stamp.of(weight))
    _SAME.get(weight, {}).pop((group_name, c), None)  # a graph compiled before the weight changed
    return held.shards


def gathered_shards(
    weight: torch.Tensor,
    group_name: str,
    c: int,
    name: str = "a q weight",
    compiling: bool = False,
    held: Optional[_Held] = None,
) -> list[torch.Tensor]:
    """Every DCP rank's shard of `weight`: gathered on first use (collective), then cached.
    `compiling`: a compile, where every rank gathers together: a changed weight is gathered
    again there.

    The cached shards of the other ranks are copies: a weight written in place afterwards
    (``load_state_dict``, ``p.copy_``) or given new storage (``p.data = ...``) would leave
    them stale, and the graph would mix this rank's new heads with the others' old ones.
    Such a change raises :class:`DcpWeightsError` (`name` says which weight) instead;
    :func:`refresh_weights` gathers them again. Writes torch does not count (through
    ``p.data``, or a collective such as ``dist.broadcast`` into the weight) cannot be seen
    here: after them, :func:`refresh_weights` is required. `held`: the weight's entry, when
    the caller has it."""
    if held is None:
        held = _GATHERED.get(weight, {}).get((group_name, c))
    if held is None or (compiling and not held.stamp.matches(weight)):
        return _gather(weight, group_name, c)
    if not held.stamp.matches(weight):
        raise DcpWeightsError(
            f"{name} changed after the first compiled call (written in place or given new storage), and "
            f"this rank holds the other DCP ranks' shards of it as they were then: call "
            f"dcp_pass.refresh_weights(model) on every rank after updating the weights (or compile with "
            f"replicate_q_proj=False and project_before_merge=False, which gather nothing)"
        )
    return held.shards


def refresh_weights(model: torch.nn.Module) -> int:
    """Bring the pass's view of `model`'s weights up to date after they changed: gather
    again the other DCP ranks' shards it holds copies of (``replicate_q_proj``,
    ``project_before_merge``), and check that the weights it found the same on every rank
    (which its graphs use for the other ranks' heads) still are. Call it on every rank of
    the DCP group after every update of the weights: the gathers and checks are
    collectives, made in the order of the model's parameter names, the same on every rank.
    Returns how many weights it gathered or checked; 0 when the pass relies on none.

    A weight that was the same on every rank when a graph was compiled and differs now (a
    model compiled with placeholder weights, then loaded) raises DcpWeightsError: the
    compiled graph has no input for the other ranks' copies; compile again after loading
    (``torch._dynamo.reset()``, then ``torch.compile``)."""
    count = 0
    for name, param in sorted(model.named_parameters(remove_duplicate=True), key=lambda item: item[0]):
        for group_name, c in sorted(_GATHERED.get(param, {})):
            _gather(param, group_name, c)
            count += 1
        for group_name, c in sorted(_SAME.get(param, {})):
            if weights_differ(param, group_name, c):
                raise DcpWeightsError(
                    f"the weight {name} was the same on every DCP rank when the graph was compiled, and differs "
                    f"across them now: the compiled graph computes the other ranks' heads with this rank's copy; "
                    f"compile again after loading the weights (torch._dynamo.reset(), then torch.compile)"
                )
            remember_same(param, group_name, c)
            count += 1
    return count


def weights_differ(weight: torch.Tensor, group_name: str, c: int, no_verdict: bool = False) -> bool:
    """Whether `weight` differs across the ranks of the group, from a small fingerprint
    (size, sums, position-weighted row and column sums, a few entries), so nothing of weight
    size is gathered or kept.
    `no_verdict`: the answer on a fake (test) process group, which cannot tell."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    group = _resolve_process_group(GroupName(group_name))
    if dist.get_backend(group) == "fake":  # test process groups return garbage: no verdict
        return no_verdict
    flat = weight.detach().reshape(-1).float()
    head = flat[:8] if flat.numel() >= 8 else torch.nn.functional.pad(flat, (0, 8 - flat.numel()))
    # row and column sums weighted by position: shards that hold the same values in another
    # order (two heads swapped) differ there
    table = flat.reshape(weight.shape[0], -1) if weight.dim() and flat.numel() else flat.reshape(1, -1)
    rows = (table.sum(1) * torch.arange(1, table.shape[0] + 1, device=flat.device)).sum()
    cols = (table.sum(0) * torch.arange(1, table.shape[1] + 1, device=flat.device)).sum()
    stats = torch.stack(
        [flat.sum(), (flat * flat).sum(), flat.abs().max() if flat.numel() else flat.new_zeros(()), rows, cols]
    )
    fingerprint = torch.cat([torch.tensor([float(flat.numel())], device=flat.device), stats, head])
    parts = [torch.empty_like(fingerprint) for _ in range(c)]
    dist.all_gather(parts, fingerprint, group=group)
    return not all(torch.equal(parts[0], p) for p in parts[1:])


def shards_lookup(group_name: str, c: int, name: str) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Per call: every DCP rank's shard of the weight passed (`gathered_shards`; `name` says
    which weight in errors), its entry remembered per weight."""
    recent = _Recent(_GATHERED, (group_name, c))
    return lambda weight: gathered_shards(weight, group_name, c, name, held=recent(weight))


def same_weight_check(group_name: str, c: int, name: str) -> Callable[[torch.Tensor], None]:
    """Per call: raise if the weight passed, taken as the same on every rank, changed since
    (`check_same_unchanged`)."""
    recent = _Recent(_SAME, (group_name, c))
    return lambda weight: check_same_unchanged(weight, group_name, c, name, recent(weight))
