"""DCP collectives: query-head gather, partial-result exchange, backend choice.

All exchanges are written with functional collectives
(``torch.ops._c10d_functional.*`` followed by ``wait_tensor``) and take the group by
its ``group_name`` string, so when the compile pass emits them they are ordinary
graph nodes that dynamo / aot_autograd / inductor trace and schedule. Nothing here
calls ``.item()`` or otherwise syncs with the host.

Shapes follow the compile pass's canonical layout: partial output ``o`` is
[..., H, D] (normally [B, S, H, D]) and its fp32 LSE is [..., H]. Head chunk ``j``
(heads ``j*H/c .. (j+1)*H/c``) belongs to DCP rank ``j``; the c partials of a row are
merged in DCP-rank order, which is also KV-shard order.

Backends (docs/usage.md, option comm_backend; the table every chooser reads is COMM_BACKENDS, defined here
beside the exchanges and re-exported by runtime/decode/backends.py):
  * ``a2a``    one packed all-to-all of (output, LSE), then a local exact merge;
  * ``ag_rs``  LSE all-gather, local fp32 rescale, fp32 reduce-scatter of outputs;
  * ``fi_a2a`` FlashInfer's MNNVL all-to-all (Blackwell, one MNNVL domain).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from dcp_pass.runtime.decode.merge import (
    check_base,
    global_lse,
    merge_packed,
    merge_partials_dispatch,
    pack_output_lse,
    rescale_partial,
)

__all__ = [
    "COMM_BACKENDS",
    "DEFAULT_COMM_PREFERENCE",
    "CommBackend",
    "CommBackendUnavailable",
    "comm_backend_blockers",
    "gather_heads",
    "exchange_a2a",
    "exchange_ag_rs",
    "exchange_replicated",
    "exchange_fi_a2a",
    "resolve_comm_backend",
    "device_comm_facts",
    "select_comm_backend",
]


_fc = torch.ops._c10d_functional


# an exchange's result: the merged output, or (output, LSE) with `return_lse`
ExchangeResult = Union[Tensor, Tuple[Tensor, Tensor]]


class CommBackendUnavailable(RuntimeError):
    """A communication backend was asked for where it cannot run."""


# --------------------------------------------------------------------------------------
# thin wrappers: one functional collective + its wait, so every call is one graph node pair;
# a group of one (c == 1) issues no collective at all


def _all_gather0(x: Tensor, group_name: str, c: int) -> Tensor:
    """[*s] -> [c, *s], slot j holding DCP rank j's tensor."""
    if c == 1:
        return x.unsqueeze(0)
    if _gathers_by_all_to_all(x, group_name):
        return _all_to_all0(x.unsqueeze(0).expand(c, *x.shape), group_name, c)
    out = _fc.all_gather_into_tensor(x.contiguous().unsqueeze(0), c, group_name)
    return _fc.wait_tensor(out)


def _gathers_by_all_to_all(x: Tensor, group_name: str) -> bool:
    """Whether the all-gather goes through all_to_all_single (each rank sends its tensor to
    every rank): a gloo group given CUDA tensors (ranks sharing one GPU, a functional test
    set-up) crashes in torch's functional all_gather_into_tensor (torch 2.11: a segfault in
    wait_tensor) and runs its all_to_all_single. Decided while tracing, from the group and
    the tensor's device: the same on every rank."""
    if x.device.type != "cuda":
        return False
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_backend(_resolve_process_group(group_name)) == "gloo"


def _all_to_all0(x: Tensor, group_name: str, c: int) -> Tensor:
    """[c, *s] -> [c, *s]: slot j is sent to rank j; slot r of the result came from rank r."""
    if c == 1:
        return x
    splits = [1] * c
    out = _fc.all_to_all_single(x.contiguous(), splits, splits, group_name)
    return _fc.wait_tensor(out)


def _reduce_scatter0(x: Tensor, group_name: str, c: int) -> Tensor:
    """[c, *s] summed over ranks; rank j keeps slot j -> [*s]."""
    if c == 1:
        return x.squeeze(0)
    out = _fc.reduce_scatter_tensor(x.contiguous(), "sum", c, group_name)
    return _fc.wait_tensor(out).squeeze(0)


def _all_reduce(x: Tensor, group_name: str, c: int) -> Tensor:
    if c == 1:
        return x
    return _fc.wait_tensor(_fc.all_reduce(x.contiguous(), "sum", group_name))


def _group_rank(group_name: str, c: int) -> int:
    """This process's rank in the DCP group named `group_name` (0 for a group of one)."""
    if c == 1:
        return 0
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(group_name))


def _check_exchange_args(o: Tensor, lse: Tensor, c: int, split_heads: bool) -> None:
    if c < 1:
        raise ValueError(f"DCP group size c must be >= 1, got {c}")
    if o.dim() < 2 or o.shape[:-1] != lse.shape:
        raise ValueError(f"expected o [..., H, D] and lse [..., H]; got o {tuple(o.shape)}, lse {tuple(lse.shape)}")
    if split_heads and o.shape[-2] % c != 0:
        raise ValueError(f"head count {o.shape[-2]} is not divisible by the DCP group size {c}")


# --------------------------------------------------------------------------------------
# query heads


def gather_heads(x: Tensor, group_name: str, c: int) -> Tensor:
    """All-gather query heads: [..., Hl, D] -> [..., c*Hl, D], DCP rank j's heads j-th."""
    if x.dim() < 2:
        raise ValueError(f"gather_heads expects [..., H, D], got {tuple(x.shape)}")
    if c == 1:
        return x
    g = _all_gather0(x, group_name, c)  # [c, ..., Hl, D]
    # Move the rank slot next to the local heads so (rank, head) flattens rank-major.
    return g.movedim(0, -3).flatten(-3, -2)


# --------------------------------------------------------------------------------------
# head-sharded exchanges: every rank ends with its TP-local head shard


def _lse_acc(lse: Tensor) -> Tensor:
    """The LSE as exchanged by the ag_rs paths: fp32, or fp64 when it is fp64 (fp64 models)."""
    return lse if lse.dtype == torch.float64 else lse.float()


def _chunks_first(t: Tensor, c: int) -> Tensor:
    """[..., H, X] -> [c, ..., H/c, X]: head chunk j in slot j."""
    return t.unflatten(-2, (c, t.shape[-2] // c)).movedim(-3, 0)


def exchange_a2a(
    o: Tensor,
    lse: Tensor,
    group_name: str,
    c: int,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> ExchangeResult:
    """Packed all-to-all + exact merge: o [..., Hg, D], lse [..., Hg] -> [..., Hg/c, D].

    Output and LSE travel in ONE buffer (pack_output_lse), so this is one collective.
    With ``return_lse`` also the merged LSE of this rank's heads, [..., Hg/c].
    """
    check_base(base)
    _check_exchange_args(o, lse, c, split_heads=True)
    D = o.shape[-1]
    packed = pack_output_lse(o, lse)  # [..., Hg, D + k]
    send = _chunks_first(packed, c)  # [c, ..., Hl, D + k]
    recv = _all_to_all0(send, group_name, c)
    return merge_packed(recv, D, base, out_dtype, return_lse)


def exchange_ag_rs(
    o: Tensor,
    lse: Tensor,
    group_name: str,
    c: int,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> ExchangeResult:
    """LSE all-gather, fp32 rescale, fp32 reduce-scatter over heads -> [..., Hg/c, D].

    For platforms without an all-to-all. The reduce-scatter sums in fp32 so the result
    matches the a2a path to fp32 rounding rather than to the output dtype's rounding.
    With ``return_lse`` also the merged LSE of this rank's heads (its chunk of the gathered
    LSE, every rank having merged all of them).
    """
    check_base(base)
    _check_exchange_args(o, lse, c, split_heads=True)
    out_dtype = o.dtype if out_dtype is None else out_dtype
    g = global_lse(_all_gather0(_lse_acc(lse), group_name, c), base)  # [..., Hg]
    contrib = rescale_partial(o, lse, g, base)  # fp32 [..., Hg, D]
    send = _chunks_first(contrib, c)  # [c, ..., Hl, D]
    out = _reduce_scatter0(send, group_name, c).to(out_dtype)
    if not return_lse:
        return out
    return out, _chunks_first(g.unsqueeze(-1), c)[_group_rank(group_name, c)].squeeze(-1)


# --------------------------------------------------------------------------------------
# head-replicated mode: every rank computed ALL heads over its KV shard and needs all heads


def exchange_replicated(
    o: Tensor,
    lse: Tensor,
    group_name: str,
    c: int,
    method: str = "a2a",
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> ExchangeResult:
    """Merge head-replicated partials: o [..., H, D], lse [..., H] -> merged [..., H, D] on every rank.

    method "a2a": one all-gather of the packed partials, then a local merge (every
    rank needs every head, so the "all-to-all" degenerates into an all-gather).
    method "ag_rs": LSE all-gather + fp32 rescale + fp32 all-reduce.
    With ``return_lse`` also the merged LSE [..., H].
    """
    check_base(base)
    _check_exchange_args(o, lse, c, split_heads=False)
    out_dtype = o.dtype if out_dtype is None else out_dtype
    if method == "a2a":
        packed = pack_output_lse(o, lse)
        return merge_packed(_all_gather0(packed, group_name, c), o.shape[-1], base, out_dtype, return_lse)
    if method == "ag_rs":
        g = global_lse(_all_gather0(_lse_acc(lse), group_name, c), base)
        out = _all_reduce(rescale_partial(o, lse, g, base), group_name, c).to(out_dtype)
        return (out, g) if return_lse else out
    raise ValueError(f"exchange_replicated: method must be 'a2a' or 'ag_rs', got {method!r}")


# --------------------------------------------------------------------------------------
# FlashInfer MNNVL all-to-all (Blackwell only)
#
# Not exercised by this repository's tests: no Blackwell machine or flashinfer is
# available here. It follows FlashInfer's documented decode-CP API
# (decode_cp_a2a_allocate_mnnvl_workspace / decode_cp_a2a_init_workspace /
# decode_cp_a2a_alltoall); anything that does not line up is reported as
# CommBackendUnavailable instead of failing somewhere deep inside.

_FI_WORKSPACES: Dict[Any, Any] = {}


def _fi_a2a_unavailable_reason(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"it needs a CUDA device, the tensors are on {device.type}"
    if torch.version.hip is not None:
        return "it needs an NVIDIA Blackwell GPU, this is ROCm"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return f"it needs a Blackwell GPU (compute capability 10.x), this device is {major}.{minor}"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    try:
        import flashinfer.comm as fic
    except Exception as e:  # noqa: BLE001 - any import failure makes it unavailable
        return f"flashinfer.comm failed to import ({type(e).__name__}: {e})"
    if not hasattr(fic, "decode_cp_a2a_alltoall"):
        return "this flashinfer version has no decode_cp_a2a_alltoall"
    return None


def _fi_workspace(group_name: str, c: int, device: torch.device):
    from torch.distributed.distributed_c10d import _resolve_process_group

    key = (group_name, c, str(device))
    group = _resolve_process_group(group_name)
    held = _FI_WORKSPACES.get(key)
    # kept with the group it was made for: a group name is reused once the default group is
    # destroyed and made again, and the old workspace's peers and rank are not the new ones'
    if held is None or held[0] is not group:
        import flashinfer.comm as fic

        rank = dist.get_rank(group)
        try:
            from flashinfer.comm.mnnvl import MnnvlConfig, TorchDistBackend

            mapping = fic.Mapping(world_size=c, rank=rank, gpus_per_node=torch.cuda.device_count(), cp_size=c)
            ws = fic.decode_cp_a2a_allocate_mnnvl_workspace(
                mapping, mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend(group))
            )
            fic.decode_cp_a2a_init_workspace(ws, rank, c)
        except Exception as e:  # noqa: BLE001
            raise CommBackendUnavailable(
                f"fi_a2a: setting up the FlashInfer MNNVL workspace failed ({type(e).__name__}: {e}); "
                "use comm backend 'a2a' or 'ag_rs'"
            ) from e
        # Peers write into each other's FIFOs: nobody may start before all are reset.
        dist.barrier(group)
        _FI_WORKSPACES[key] = held = (group, ws, rank)
    return held[1:]


def exchange_fi_a2a(
    o: Tensor,
    lse: Tensor,
    group_name: str,
    c: int,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
) -> ExchangeResult:
    """exchange_a2a on FlashInfer's MNNVL all-to-all. Eager only (setup is stateful)."""
    check_base(base)
    _check_exchange_args(o, lse, c, split_heads=True)
    reason = _fi_a2a_unavailable_reason(o.device)
    if reason is None and o.dtype not in (torch.float16, torch.bfloat16):
        reason = f"its kernel moves fp16/bf16 outputs only, got {o.dtype}"
    if reason is not None:
        raise CommBackendUnavailable(
            f"comm backend 'fi_a2a' is unavailable: {reason}. Valid backends here: 'a2a', 'ag_rs'."
        )
    import flashinfer.comm as fic

    ws, rank = _fi_workspace(group_name, c, o.device)
    # FlashInfer wants the peer axis next to the feature axis: [..., Hl, c, D], and
    # per-peer fp32 stats with an even width >= 2 (LSE in slot 0, slot 1 unused).
    send_o = _chunks_first(o, c).movedim(0, -2).contiguous()
    lse_c = _chunks_first(lse.float().unsqueeze(-1), c).movedim(0, -2).squeeze(-1)  # [..., Hl, c]
    stats = torch.stack([lse_c, torch.zeros_like(lse_c)], dim=-1).contiguous()
    recv_o, recv_stats = fic.decode_cp_a2a_alltoall(send_o, stats, ws, rank, c)
    out_dtype = o.dtype if out_dtype is None else out_dtype
    return merge_partials_dispatch(
        recv_o.movedim(-2, 0), recv_stats[..., 0].movedim(-1, 0), base, out_dtype, return_lse
    )


# --------------------------------------------------------------------------------------
# the table of comm backends


@dataclass(frozen=True)
class CommBackend:
    name: str
    # head-sharded exchange: (o, lse, group_name, c, base, out_dtype, return_lse) -> this rank's head
    # shard (and its merged LSE)
    exchange: Callable[..., torch.Tensor]
    # the `method` exchange_replicated uses for models whose heads are not sharded
    replicated_method: str
    # platform facts (resolve_comm_backend's keyword inputs) -> reasons it cannot run; [] = can
    blockers: Callable[[Mapping[str, Any]], List[str]]
    description: str


def _fi_a2a_blockers(facts: Mapping[str, Any]) -> List[str]:
    out = []
    if facts["device_type"] != "cuda":
        out.append(f"it needs a CUDA device, not {facts['device_type']!r}")
    elif not facts["is_blackwell"]:
        out.append("it needs a Blackwell GPU (compute capability 10.x)")
    if not facts["mnnvl_single_domain"]:
        out.append("the DCP group is not inside one MNNVL domain")
    if not facts["flashinfer_available"]:
        out.append("flashinfer is not available")
    return out


def _a2a_blockers(facts: Mapping[str, Any]) -> List[str]:
    if not facts["has_all_to_all"]:
        return ["the process group's backend has no all_to_all_single; use 'ag_rs'"]
    return []


# Insertion order: the preference order of the platform default (the first that can run).
# Names and order also give options.COMM_BACKENDS.
COMM_BACKENDS: Dict[str, CommBackend] = {
    "a2a": CommBackend(
        "a2a",
        exchange_a2a,
        "a2a",
        _a2a_blockers,
        "one packed all-to-all of (output, LSE), then a local exact merge",
    ),
    "ag_rs": CommBackend(
        "ag_rs",
        exchange_ag_rs,
        "ag_rs",
        lambda facts: [],
        "LSE all-gather, local fp32 rescale, fp32 reduce-scatter of outputs",
    ),
    "fi_a2a": CommBackend(
        "fi_a2a",
        exchange_fi_a2a,
        "a2a",
        _fi_a2a_blockers,
        "FlashInfer's MNNVL all-to-all (Blackwell, one MNNVL domain)",
    ),
}

# The platform default tries these in order; ag_rs runs everywhere.
DEFAULT_COMM_PREFERENCE = ("fi_a2a", "a2a", "ag_rs")


def comm_backend_blockers(name: str, facts: Mapping[str, Any]) -> List[str]:
    """Why comm backend `name` cannot run on `facts` ([] when it can)."""
    return COMM_BACKENDS[name].blockers(facts)


# --------------------------------------------------------------------------------------
# backend choice


def resolve_comm_backend(
    requested: Optional[str],
    *,
    device_type: str,
    is_blackwell: bool,
    mnnvl_single_domain: bool,
    has_all_to_all: bool,
    flashinfer_available: bool,
) -> str:
    """The default comm backend and the check of a requested one, as a pure function of the platform facts.

    Default (requested None): "fi_a2a" on a CUDA Blackwell device whose DCP group is in
    one MNNVL domain with flashinfer available; otherwise "a2a" wherever the group has
    an all-to-all (NCCL/RCCL on CUDA/ROCm, gloo on CPU); "ag_rs" only where it has none.
    An explicit request that cannot run raises ValueError saying why.
    """
    facts = dict(
        device_type=device_type,
        is_blackwell=is_blackwell,
        mnnvl_single_domain=mnnvl_single_domain,
        has_all_to_all=has_all_to_all,
        flashinfer_available=flashinfer_available,
    )
    if requested is None:
        return next(n for n in DEFAULT_COMM_PREFERENCE if not COMM_BACKENDS[n].blockers(facts))
    if requested not in COMM_BACKENDS:
        raise ValueError(
            f"unknown DCP comm backend {requested!r}; valid names are {', '.join(map(repr, COMM_BACKENDS))} "
            "(or None for the platform default)"
        )
    blockers = COMM_BACKENDS[requested].blockers(facts)
    if blockers:
        raise ValueError(f"DCP comm backend {requested!r} cannot run here: " + "; ".join(blockers) + ".")
    return requested


# Process-group backends known to implement all_to_all_single. gloo does so for CPU
# tensors only; "fake" and "threaded" are test backends that implement it.
_A2A_BACKENDS = {"nccl", "mpi", "ucc", "xccl", "hccl", "fake", "threaded"}


def _group_backend_for(group, device_type: str) -> str:
    name = str(dist.get_backend(group)).lower()
    # A mixed group reports e.g. "cpu:gloo,cuda:nccl": pick the one serving the device.
    if ":" in name:
        per_dev = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return per_dev.get(device_type, next(iter(per_dev.values()), name))
    return name


def _detect_single_mnnvl_domain(device: torch.device, group) -> bool:
    """True when every rank of ``group`` reports the same completed NVLink fabric cluster.

    Collective over ``group`` (all ranks must call it). Any failure means False: the
    caller then falls back to the ordinary all-to-all, which works everywhere.
    """
    key = None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
        info = pynvml.nvmlDeviceGetGpuFabricInfo(handle)
        if info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED and info.status == 0:
            key = bytes(info.clusterUuid).hex()
    except Exception:  # noqa: BLE001 - no NVML / no fabric info: not MNNVL
        key = None
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, key, group=group)
    return key is not None and all(k == key for k in keys)


def device_comm_facts(device, group=None, *, mnnvl_single_domain: Optional[bool] = None) -> Dict[str, Any]:
    """The platform facts resolve_comm_backend needs, read at runtime.

    ``group``: a ProcessGroup, its group_name, or None for the default group.
    Returns the five keyword inputs of resolve_comm_backend plus "compute_capability"
    and "group_backend" (for reports). On Blackwell with flashinfer present, detecting
    the MNNVL domain is a collective over ``group`` unless ``mnnvl_single_domain`` is
    given.
    """
    device = torch.device(device)
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    is_cuda = device.type == "cuda"  # ROCm devices are "cuda" too
    cc = tuple(torch.cuda.get_device_capability(device)) if is_cuda else None
    is_blackwell = bool(is_cuda and torch.version.hip is None and cc[0] == 10)
    backend = _group_backend_for(group, device.type) if dist.is_initialized() else None
    has_a2a = backend in _A2A_BACKENDS or (backend == "gloo" and device.type == "cpu")
    fi = importlib.util.find_spec("flashinfer") is not None
    if mnnvl_single_domain is None:
        mnnvl_single_domain = bool(
            is_blackwell and fi and backend is not None and _detect_single_mnnvl_domain(device, group)
        )
    return {
        "device_type": "cuda" if is_cuda else device.type,
        "is_blackwell": is_blackwell,
        "mnnvl_single_domain": bool(mnnvl_single_domain),
        "has_all_to_all": bool(has_a2a),
        "flashinfer_available": fi,
        "compute_capability": cc,
        "group_backend": backend,
    }


_RESOLVE_KEYS = ("device_type", "is_blackwell", "mnnvl_single_domain", "has_all_to_all", "flashinfer_available")


def select_comm_backend(requested: Optional[str], device, group=None, **facts_kwargs) -> str:
    """resolve_comm_backend on the facts of this device and group."""
    facts = device_comm_facts(device, group, **facts_kwargs)
    return resolve_comm_backend(requested, **{k: facts[k] for k in _RESOLVE_KEYS})


# --------------------------------------------------------------------------------------
# eager entry point for runtime features (extend, speculative verification)


def exchange_partials(
    o: Tensor,
    lse: Tensor,
    method: Optional[str],
    group=None,
    c: int = 1,
    base: str = "e",
    out_dtype: Optional[torch.dtype] = None,
):
    """Merge rank-local partials with `method` ("a2a" | "ag_rs" | "replicated"); None
    returns them unmerged. `group`: a ProcessGroup, its name, or None for WORLD."""
    if method is None:
        return o, lse
    if c == 1:
        name = ""  # no collective is issued for a group of one
    elif isinstance(group, str):
        name = group
    else:
        name = (group if group is not None else dist.group.WORLD).group_name
    if method in ("a2a", "ag_rs"):
        return COMM_BACKENDS[method].exchange(o, lse, name, c, base, out_dtype)
    if method == "replicated":
        return exchange_replicated(o, lse, name, c, COMM_BACKENDS["a2a"].replicated_method, base, out_dtype)
    raise ValueError(f"exchange must be None, 'a2a', 'ag_rs' or 'replicated', got {method!r}")
