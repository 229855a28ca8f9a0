"""KV transfer plans for prefill/decode (PD) disaggregation with DCP on the decode side.

A prefill server writes a request's KV into its own paged pool; the decode server
must receive it in its own layout. With DCP on the decode side that layout is
striped (docs/compositions.md, section 1): decode rank ``r`` of a DCP group of size ``c``
stores token ``p`` of the request only if ``p % c == r``, at physical slot
``v // c`` where ``v`` is the token's virtual index on the decode side. Dense
prefill pages therefore cannot be copied page-for-page; a plan built from the
decode rank's DCP metadata selects and packs the right rows.

Supported transitions (everything else is rejected with an error naming it):

* ``mode == "page"``: the same DCP size on both sides (including 1 -> 1). Prefill
  DCP rank ``r`` sends to decode DCP rank ``r`` (the ranks must match), page for
  page; every page is whole except the last, whose token count is exact.
* ``mode == "relayout"``: DCP 1 prefill -> DCP ``c`` decode, for MLA and
  hybrid-MLA pools. Decode rank ``r`` receives exactly the tokens ``p`` with
  ``p % c == r``, packed into its slots.

Requirements on both sides: the same physical page size and KV dtype; prefill
attention context parallelism must be 1. Recurrent-state pools (linear attention:
KDA, Mamba) do not go through DCP at all: :func:`build_state_transfer` keeps their
attention-TP mapping and moves whole per-request states.

Pools are flat ``[rows, ...]`` tensors: row ``page * P + offset``. A paged pool
shaped ``[pages, P, ...]`` is passed as ``pool.flatten(0, 1)`` (a view).

The plans carry exact token counts: only the rows of real tokens move, so stale
rows of a partial last page never reach the decode pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from dcp_pass.runtime.decode.layout import local_length, owned_positions, owner, physical, whole_page_ids

__all__ = [
    "TransferPlanError",
    "PageLayout",
    "TransferPlan",
    "StateTransferPlan",
    "ATTENTION_POOL_KINDS",
    "build_transfer_plan",
    "build_transfer_plan_from_allocator",
    "build_state_transfer",
    "pack_rows",
    "unpack_rows_",
    "execute_transfer",
]

#: Pool kinds whose KV is striped by DCP and may be relaid out (attention KV; recurrent state is not striped).
ATTENTION_POOL_KINDS = ("mla", "hybrid_mla")
_STATE_POOL_KINDS = ("recurrent", "state", "linear_attention", "mamba", "kda")


class TransferPlanError(ValueError):
    """A prefill -> decode transfer that this project does not support."""


@dataclass(frozen=True)
class PageLayout:
    """How one side (prefill or decode) lays out its KV pool.

    ``dcp_size``/``dcp_rank``: the DCP group of this process (1/0 without DCP).
    ``page_size``: physical page size P (rows per page of this rank's pool).
    ``kv_dtype``: dtype of the pool rows. ``attn_cp_size``: attention context
    parallelism of the side (prefill must have 1).
    """

    dcp_size: int = 1
    dcp_rank: int = 0
    page_size: int = 1
    kv_dtype: torch.dtype = torch.bfloat16
    attn_cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dcp_size", "page_size", "attn_cp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TransferPlanError(f"PageLayout.{name} must be an int >= 1, got {value!r}")
        if not _is_index(self.dcp_rank) or not self.dcp_rank < self.dcp_size:
            raise TransferPlanError(
                f"PageLayout.dcp_rank must satisfy 0 <= dcp_rank < dcp_size={self.dcp_size}, got {self.dcp_rank!r}"
            )
        if not isinstance(self.kv_dtype, torch.dtype):
            raise TransferPlanError(f"PageLayout.kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")


@dataclass(frozen=True)
class TransferPlan:
    """Rows one prefill rank sends to one decode rank for one request.

    ``src_rows[i]`` (row of the prefill pool) lands at ``dst_slots[i]`` (physical slot
    of the decode rank's pool); ``positions[i]`` is the token's position in the
    request. All three are int64 CPU tensors of length ``rank_tokens``.
    ``num_tokens`` is the exact request length and ``rank_token_counts[r]`` the number
    of its tokens decode rank ``r`` holds (``local_length(num_tokens, c, r)``).
    ``src_pages``/``dst_pages``/``page_token_counts`` describe the same move page by
    page in page mode (every page whole except the last, whose count is exact);
    they are empty in relayout mode, where rows come from many prefill pages.
    """

    mode: str
    prefill: PageLayout
    decode: PageLayout
    num_tokens: int
    rank_token_counts: tuple[int, ...]
    src_rows: torch.Tensor
    dst_slots: torch.Tensor
    positions: torch.Tensor
    src_pages: tuple[int, ...] = ()
    dst_pages: tuple[int, ...] = ()
    page_token_counts: tuple[int, ...] = ()
    pool_kind: str = "mla"

    @property
    def rank_tokens(self) -> int:
        """Tokens moved by this plan (= ``rank_token_counts[decode.dcp_rank]``)."""
        return int(self.src_rows.numel())

    @property
    def src_dcp_rank(self) -> int:
        return self.prefill.dcp_rank

    @property
    def dst_dcp_rank(self) -> int:
        return self.decode.dcp_rank


@dataclass(frozen=True)
class StateTransferPlan:
    """Move one request's recurrent state (or a head range of it) between TP ranks.

    The state pool is ``[slots, heads_local, ...]`` on every attention-TP rank. Heads
    ``[src_head_start, src_head_end)`` of slot ``src_slot`` on prefill attention-TP
    rank ``src_tp_rank`` land at heads ``[dst_head_start, dst_head_end)`` of slot
    ``dst_slot`` on decode attention-TP rank ``dst_tp_rank``. DCP plays no part.
    """

    src_tp_rank: int
    dst_tp_rank: int
    src_slot: int
    dst_slot: int
    src_head_start: int
    src_head_end: int
    dst_head_start: int
    dst_head_end: int

    def __post_init__(self) -> None:
        for name in (
            "src_tp_rank",
            "dst_tp_rank",
            "src_slot",
            "dst_slot",
            "src_head_start",
            "src_head_end",
            "dst_head_start",
            "dst_head_end",
        ):
            _check_index(f"StateTransferPlan.{name}", getattr(self, name))
        if self.src_head_end < self.src_head_start or self.dst_head_end < self.dst_head_start:
            raise TransferPlanError(
                f"StateTransferPlan head ranges must not be reversed: src_head_start={self.src_head_start}, "
                f"src_head_end={self.src_head_end}, dst_head_start={self.dst_head_start}, "
                f"dst_head_end={self.dst_head_end}"
            )
        if self.src_head_end - self.src_head_start != self.dst_head_end - self.dst_head_start:
            raise TransferPlanError(
                f"StateTransferPlan moves {self.src_head_end - self.src_head_start} source heads into "
                f"{self.dst_head_end - self.dst_head_start} destination heads"
            )

    @property
    def num_heads(self) -> int:
        return self.src_head_end - self.src_head_start


# ------------------------------------------------------------------------ validation


def _is_index(value) -> bool:
    # bool is an int subclass; False/True as a rank or slot is a caller bug, not 0/1
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_index(name: str, value) -> None:
    """A slot, page or rank: a non-negative int. A negative one would index from the end
    (slot -1 is the pool's last slot: another request's)."""
    if not _is_index(value):
        raise TransferPlanError(f"{name} must be an int >= 0, got {name}={value!r}")


def _check_size(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TransferPlanError(f"{name} must be an int >= 1, got {name}={value!r}")


def _first_duplicate(t: torch.Tensor) -> Optional[int]:
    """Some value that occurs more than once in the 1-D tensor ``t``, or None."""
    if t.numel() < 2:
        return None
    values, counts = torch.unique(t, return_counts=True)
    twice = values[counts > 1]
    return int(twice[0]) if twice.numel() else None


def _check_pair(prefill: PageLayout, decode: PageLayout, pool_kind: str) -> str:
    if pool_kind in _STATE_POOL_KINDS:
        raise TransferPlanError(
            f"pool_kind={pool_kind!r} is a recurrent-state pool: it keeps its attention-TP "
            f"mapping and bypasses DCP filtering; use build_state_transfer()"
        )
    if pool_kind not in ATTENTION_POOL_KINDS:
        raise TransferPlanError(
            f"pool_kind={pool_kind!r} is not supported; DCP KV transfer handles {ATTENTION_POOL_KINDS}"
        )
    if prefill.attn_cp_size != 1:
        raise TransferPlanError(
            f"prefill attention CP size must be 1 for a DCP transfer, got prefill attn_cp_size={prefill.attn_cp_size}"
        )
    if prefill.page_size != decode.page_size:
        raise TransferPlanError(
            f"physical page size mismatch: prefill page_size={prefill.page_size} != decode page_size={decode.page_size}"
        )
    if prefill.kv_dtype != decode.kv_dtype and torch.uint8 in (prefill.kv_dtype, decode.kv_dtype):
        raise TransferPlanError(
            f"KV dtype mismatch: prefill kv_dtype={prefill.kv_dtype} != decode kv_dtype={decode.kv_dtype}; "
            f"an fp8 striped cache (kv_cache_dtype='fp8_e4m3') stores packed uint8 rows: quantise the prefill "
            f"rows with dcp_pass.runtime.decode.kv_format.pack before the transfer, so both sides move the same rows"
        )
    if prefill.kv_dtype != decode.kv_dtype:
        raise TransferPlanError(
            f"KV dtype mismatch: prefill kv_dtype={prefill.kv_dtype} != decode kv_dtype={decode.kv_dtype}"
        )
    if prefill.dcp_size == decode.dcp_size:
        if prefill.dcp_rank != decode.dcp_rank:
            raise TransferPlanError(
                f"DCP rank mismatch in page mode (DCP size {decode.dcp_size} on both sides): "
                f"prefill dcp_rank={prefill.dcp_rank} != decode dcp_rank={decode.dcp_rank}"
            )
        return "page"
    if prefill.dcp_size == 1:
        return "relayout"
    raise TransferPlanError(
        f"unsupported DCP size transition prefill dcp_size={prefill.dcp_size} -> decode "
        f"dcp_size={decode.dcp_size}: supported are equal sizes (page mode) and 1 -> c "
        f"(token relayout)"
    )


def _as_long_1d(name: str, x: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
    t = torch.as_tensor(x).to("cpu")
    if t.dim() != 1:
        raise TransferPlanError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TransferPlanError(f"{name} must hold integers, got {t.dtype}")
    t = t.long()
    if t.numel() and int(t.min()) < 0:
        raise TransferPlanError(f"{name} holds a negative index {int(t.min())}")
    return t


# ------------------------------------------------------------------------------ plans


def build_transfer_plan(
    prefill: PageLayout,
    decode: PageLayout,
    prefill_page_table: Union[torch.Tensor, Sequence[int]],
    num_tokens: int,
    decode_token_indices: Union[torch.Tensor, Sequence[int]],
    pool_kind: str = "mla",
) -> TransferPlan:
    """Plan the rows one prefill rank sends to one decode rank for one request.

    ``prefill_page_table``: the request's page ids on the prefill side, in token
    order (with prefill DCP ``c > 1`` these are its widened virtual pages, which are
    also its physical pages on every prefill rank). ``decode_token_indices``: the
    request's virtual token indices on the decode side (``req_to_token``; at least
    ``num_tokens`` entries; only the first ``num_tokens`` are used). Decode rank
    ``r`` must own exactly the positions ``p % c == r`` (true for page-aligned
    allocations such as :class:`~dcp_pass.runtime.decode.layout.PagedVirtualAllocator`).
    """
    mode = _check_pair(prefill, decode, pool_kind)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise TransferPlanError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    page_table = _as_long_1d("prefill_page_table", prefill_page_table)
    dec_idx = _as_long_1d("decode_token_indices", decode_token_indices)
    P = prefill.page_size
    c_pre, c_dec = prefill.dcp_size, decode.dcp_size
    r_dec = decode.dcp_rank

    dec_idx = _checked_capacity(page_table, dec_idx, num_tokens, P, c_pre, c_dec)
    counts = tuple(int(local_length(num_tokens, c_dec, r)) for r in range(c_dec))
    positions, src_rows, dst_slots = _token_rows(page_table, dec_idx, num_tokens, P, c_pre, c_dec, r_dec)
    if mode == "page":
        src_pages, dst_pages, page_counts = _page_runs(page_table, dst_slots, counts[r_dec], P)
    else:
        src_pages = dst_pages = page_counts = ()
    _check_duplicates(page_table, dec_idx, positions, dst_slots, num_tokens, P, c_pre, r_dec)
    return TransferPlan(
        mode=mode,
        prefill=prefill,
        decode=decode,
        num_tokens=num_tokens,
        rank_token_counts=counts,
        src_rows=src_rows.contiguous(),
        dst_slots=dst_slots.contiguous(),
        positions=positions,
        src_pages=src_pages,
        dst_pages=dst_pages,
        page_token_counts=page_counts,
        pool_kind=pool_kind,
    )


def _checked_capacity(
    page_table: torch.Tensor, dec_idx: torch.Tensor, num_tokens: int, P: int, c_pre: int, c_dec: int
) -> torch.Tensor:
    """Capacity checks: the prefill pages must hold the request, the decode map cover it
    (position-aligned); returns the first `num_tokens` decode indices."""
    prefill_tokens = page_table.numel() * P * c_pre
    if num_tokens > prefill_tokens:
        raise TransferPlanError(
            f"num_tokens={num_tokens} exceeds the prefill page table's capacity: "
            f"{page_table.numel()} pages x {P * c_pre} tokens = {prefill_tokens}"
        )
    if dec_idx.numel() < num_tokens:
        raise TransferPlanError(
            f"decode_token_indices has {dec_idx.numel()} entries, fewer than num_tokens={num_tokens}"
        )
    dec_idx = dec_idx[:num_tokens]
    all_pos = torch.arange(num_tokens, dtype=torch.long)
    misplaced = owner(dec_idx, c_dec) != all_pos % c_dec
    if bool(misplaced.any()):
        p = int(torch.nonzero(misplaced)[0])
        raise TransferPlanError(
            f"decode_token_indices are not position-aligned for DCP size {c_dec}: token {p} has "
            f"virtual index {int(dec_idx[p])} owned by decode rank {int(owner(dec_idx[p], c_dec))}, "
            f"expected rank {p % c_dec} (allocate whole widened pages of {P * c_dec} slots)"
        )
    return dec_idx


def _token_rows(
    page_table: torch.Tensor, dec_idx: torch.Tensor, num_tokens: int, P: int, c_pre: int, c_dec: int, r_dec: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions decode rank `r_dec` owns, their prefill source rows, their decode slots)."""
    positions = owned_positions(0, num_tokens, c_dec, r_dec)  # p % c_dec == r_dec
    dst_slots = physical(dec_idx[positions], c_dec)
    # Index of each token among the prefill rank's own rows: in page mode prefill rank
    # r stores the same positions in the same local order, with DCP1 prefill (relayout)
    # it is the position itself. Local row j sits at offset j % P of page page_table[j // P].
    local = positions // c_pre
    src_rows = page_table[local // P] * P + local % P
    return positions, src_rows, dst_slots


def _page_runs(
    page_table: torch.Tensor, dst_slots: torch.Tensor, n_local: int, P: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Page mode: (source pages, destination pages, tokens per page)."""
    n_pages = -(-n_local // P)
    src_pages = tuple(int(x) for x in page_table[:n_pages])
    page_counts = tuple(min(P, n_local - i * P) for i in range(n_pages))
    # The decode side must keep whole pages together (true for the paged allocator).
    pages = whole_page_ids(dst_slots, P)
    if pages is None:
        raise TransferPlanError(
            "decode_token_indices do not map the request's local rows onto whole physical "
            "pages; page mode needs page-aligned decode allocations"
        )
    dst_pages = tuple(int(x) for x in pages)
    return src_pages, dst_pages, page_counts


def _check_duplicates(
    page_table: torch.Tensor,
    dec_idx: torch.Tensor,
    positions: torch.Tensor,
    dst_slots: torch.Tensor,
    num_tokens: int,
    P: int,
    c_pre: int,
    r_dec: int,
) -> None:
    """Two tokens on one decode slot would overwrite each other (index_copy_ keeps one of
    them); two tokens read from one prefill row means the page table repeats a page."""
    dup = _first_duplicate(dst_slots)
    if dup is not None:
        p = positions[dst_slots == dup][:2].tolist()
        raise TransferPlanError(
            f"decode_token_indices put two tokens on one decode slot: positions {p[0]} and {p[1]} both "
            f"map to decode slot {dup} of decode dcp_rank {r_dec} (duplicate virtual indices "
            f"{dec_idx[p[0]].item()}, {dec_idx[p[1]].item()})"
        )
    used_pages = page_table[: -(-num_tokens // (P * c_pre))]
    dup = _first_duplicate(used_pages)
    if dup is not None:
        raise TransferPlanError(
            f"prefill_page_table lists prefill page {dup} twice among the {used_pages.numel()} pages "
            f"holding the request's {num_tokens} tokens: its rows would be sent for two tokens each"
        )


def build_transfer_plan_from_allocator(
    prefill: PageLayout,
    decode: PageLayout,
    prefill_page_table: Union[torch.Tensor, Sequence[int]],
    allocator,
    request_id,
    pool_kind: str = "mla",
) -> TransferPlan:
    """:func:`build_transfer_plan` with the decode metadata read from a
    :class:`~dcp_pass.runtime.decode.layout.PagedVirtualAllocator` (the request must already
    be allocated there with its full length)."""
    if allocator.c != decode.dcp_size:
        raise TransferPlanError(f"decode allocator DCP size {allocator.c} != decode dcp_size={decode.dcp_size}")
    if allocator.physical_page_size != decode.page_size:
        raise TransferPlanError(
            f"decode allocator page size {allocator.physical_page_size} != decode page_size={decode.page_size}"
        )
    num_tokens = allocator.seq_len(request_id)
    return build_transfer_plan(
        prefill, decode, prefill_page_table, num_tokens, allocator.req_to_token(request_id), pool_kind
    )


def build_state_transfer(
    num_heads: int,
    prefill_attn_tp_size: int,
    decode_attn_tp_size: int,
    decode_attn_tp_rank: int,
    src_slot: int,
    dst_slot: int,
    decode_dcp_size: int = 1,
) -> list[StateTransferPlan]:
    """Plans moving one request's recurrent state to one decode attention-TP rank.

    Recurrent state (KDA / Mamba) is sharded by heads over attention TP and is
    untouched by DCP (DCP stripes attention KV only): decode rank ``t`` receives the state of heads
    ``[t*H/Td, (t+1)*H/Td)``, whatever its DCP rank, from the prefill rank(s) that
    hold those heads. ``decode_dcp_size`` is accepted (and validated) only to make
    explicit that it does not change the mapping. Returns one plan per source rank.
    """
    for name, v in (
        ("num_heads", num_heads),
        ("prefill_attn_tp_size", prefill_attn_tp_size),
        ("decode_attn_tp_size", decode_attn_tp_size),
        ("decode_dcp_size", decode_dcp_size),
    ):
        _check_size(name, v)
    for name, v in (("decode_attn_tp_rank", decode_attn_tp_rank), ("src_slot", src_slot), ("dst_slot", dst_slot)):
        _check_index(name, v)
    if not decode_attn_tp_rank < decode_attn_tp_size:
        raise TransferPlanError(
            f"decode_attn_tp_rank={decode_attn_tp_rank} out of range for decode_attn_tp_size={decode_attn_tp_size}"
        )
    if decode_attn_tp_size % decode_dcp_size:
        raise TransferPlanError(
            f"decode attn_tp_size={decode_attn_tp_size} must be a multiple of decode dcp_size={decode_dcp_size}"
        )
    for side, tp in (("prefill", prefill_attn_tp_size), ("decode", decode_attn_tp_size)):
        if num_heads % tp:
            raise TransferPlanError(
                f"num_heads={num_heads} of the recurrent state is not divisible by the {side} attention TP size {tp}"
            )
    hp, hd = num_heads // prefill_attn_tp_size, num_heads // decode_attn_tp_size
    lo, hi = decode_attn_tp_rank * hd, (decode_attn_tp_rank + 1) * hd
    plans = []
    for src in range(lo // hp, -(-hi // hp)):
        s_lo, s_hi = max(lo, src * hp), min(hi, (src + 1) * hp)
        plans.append(
            StateTransferPlan(
                src_tp_rank=src,
                dst_tp_rank=decode_attn_tp_rank,
                src_slot=src_slot,
                dst_slot=dst_slot,
                src_head_start=s_lo - src * hp,
                src_head_end=s_hi - src * hp,
                dst_head_start=s_lo - lo,
                dst_head_end=s_hi - lo,
            )
        )
    return plans


# ---------------------------------------------------------------------- pack / unpack

Plan = Union[TransferPlan, StateTransferPlan]


def _check_pool_dtype(pool: torch.Tensor, plan: Plan, side: str) -> None:
    if isinstance(plan, TransferPlan):
        layout = plan.prefill if side == "prefill" else plan.decode
        if pool.dtype != layout.kv_dtype:
            raise TransferPlanError(f"{side} pool dtype {pool.dtype} != plan {side} kv_dtype {layout.kv_dtype}")


def _check_state_bounds(pool: torch.Tensor, slot: int, h0: int, h1: int, side: str) -> None:
    # plain indexing would clip a head range past the pool (and wrap a negative slot)
    if pool.dim() < 2 or slot >= pool.shape[0] or h1 > pool.shape[1]:
        raise TransferPlanError(
            f"state plan {side} slot {slot}, heads [{h0}, {h1}) is outside the state pool of shape "
            f"{tuple(pool.shape)} ([slots, heads_local, ...])"
        )


def pack_rows(pool: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Gather the plan's source rows of ``pool`` into one contiguous buffer.

    KV plans: ``[rank_tokens, ...]`` from a flat ``[rows, ...]`` prefill pool.
    State plans: ``[heads, ...]`` from a ``[slots, heads_local, ...]`` state pool.
    """
    if isinstance(plan, StateTransferPlan):
        _check_state_bounds(pool, plan.src_slot, plan.src_head_start, plan.src_head_end, "source")
        return pool[plan.src_slot, plan.src_head_start : plan.src_head_end].contiguous()
    _check_pool_dtype(pool, plan, "prefill")
    rows = plan.src_rows.to(pool.device)
    if plan.rank_tokens and int(plan.src_rows.max()) >= pool.shape[0]:
        raise TransferPlanError(
            f"plan reads prefill row {int(plan.src_rows.max())} but the pool has {pool.shape[0]} rows"
        )
    return pool.index_select(0, rows)


def unpack_rows_(pool: torch.Tensor, plan: Plan, packed: torch.Tensor) -> torch.Tensor:
    """Scatter a packed buffer into the decode pool in place; returns ``pool``."""
    if isinstance(plan, StateTransferPlan):
        _check_state_bounds(pool, plan.dst_slot, plan.dst_head_start, plan.dst_head_end, "destination")
        pool[plan.dst_slot, plan.dst_head_start : plan.dst_head_end] = packed.to(pool.dtype)
        return pool
    _check_pool_dtype(pool, plan, "decode")
    if packed.shape[0] != plan.rank_tokens or packed.shape[1:] != pool.shape[1:]:
        raise TransferPlanError(
            f"packed buffer {tuple(packed.shape)} does not match plan rows {plan.rank_tokens} x "
            f"pool row shape {tuple(pool.shape[1:])}"
        )
    if plan.rank_tokens and int(plan.dst_slots.max()) >= pool.shape[0]:
        raise TransferPlanError(
            f"plan writes decode slot {int(plan.dst_slots.max())} but the pool has {pool.shape[0]} rows"
        )
    pool.index_copy_(0, plan.dst_slots.to(pool.device), packed.to(pool.device, pool.dtype))
    return pool


def _packed_shape(plan: Plan, dst_pool: torch.Tensor) -> tuple[int, ...]:
    if isinstance(plan, StateTransferPlan):
        return (plan.num_heads, *dst_pool.shape[2:])
    return (plan.rank_tokens, *dst_pool.shape[1:])


def execute_transfer(
    plan: Plan,
    src_pool: Optional[torch.Tensor],
    dst_pool: Optional[torch.Tensor],
    src_rank: int,
    dst_rank: int,
    group: Optional[dist.ProcessGroup] = None,
) -> int:
    """Move a plan's rows from process ``src_rank`` to process ``dst_rank``.

    Every process may call this: the source packs and sends (``src_pool`` given), the
    destination receives and unpacks (``dst_pool`` given), any other process returns
    at once. ``src_rank``/``dst_rank`` are global ranks of the default group (also
    when ``group`` names a sub-group to send on). If both are this process the copy
    is local. Uses point-to-point ``send``/``recv`` (gloo on CPU, NCCL on GPU: pools
    must then live on the current CUDA device). Returns the number of rows moved by
    this process (0 on a bystander). A plan with no rows sends nothing.
    """
    _check_index("src_rank", src_rank)
    _check_index("dst_rank", dst_rank)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    n = plan.num_heads if isinstance(plan, StateTransferPlan) else plan.rank_tokens
    if me not in (src_rank, dst_rank) or n == 0:
        return 0
    if me == src_rank and me == dst_rank:
        if src_pool is None or dst_pool is None:
            raise TransferPlanError("a local transfer needs both src_pool and dst_pool")
        unpack_rows_(dst_pool, plan, pack_rows(src_pool, plan))
        return n
    if me == src_rank:
        if src_pool is None:
            raise TransferPlanError(f"rank {me} is the transfer source but src_pool is None")
        packed = pack_rows(src_pool, plan)
        _agree_on_rows(packed.shape, packed.dtype, packed.device, dst_rank, group, sending=True)
        dist.send(packed, dst=dst_rank, group=group)
        return n
    if dst_pool is None:
        raise TransferPlanError(f"rank {me} is the transfer destination but dst_pool is None")
    shape = _packed_shape(plan, dst_pool)
    _agree_on_rows(shape, dst_pool.dtype, dst_pool.device, src_rank, group, sending=False)
    buf = torch.empty(shape, dtype=dst_pool.dtype, device=dst_pool.device)
    dist.recv(buf, src=src_rank, group=group)
    unpack_rows_(dst_pool, plan, buf)
    return n


_HEADER_DIMS = 6  # rows and up to 5 dimensions of a row, then the element size and dtype


def _rows_header(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if len(shape) > _HEADER_DIMS:
        raise TransferPlanError(f"rows of {len(shape) - 1} dimensions are more than a transfer carries")
    dims = list(shape) + [-1] * (_HEADER_DIMS - len(shape))
    code = sum(ord(ch) * 31**i for i, ch in enumerate(str(dtype))) % (1 << 40)  # the same on both sides
    return torch.tensor(dims + [dtype.itemsize, code], dtype=torch.int64, device=device)


def _agree_on_rows(shape, dtype: torch.dtype, device, peer: int, group, sending: bool) -> None:
    """Both sides of a transfer swap what they move (row count, row shape, dtype) before the
    rows: a receive buffer shorter or longer than the message would take it without a word
    (gloo fills a longer one from what arrives and leaves the rest as it was). A mismatch
    raises on both sides, before any row moves."""
    mine = _rows_header(shape, dtype, device)
    theirs = torch.empty_like(mine)
    if sending:
        dist.send(mine, dst=peer, group=group)
        dist.recv(theirs, src=peer, group=group)
    else:
        dist.recv(theirs, src=peer, group=group)
        dist.send(mine, dst=peer, group=group)
    if not torch.equal(mine, theirs):
        src, dst = (mine, theirs) if sending else (theirs, mine)

        def describe(h):
            dims = [int(d) for d in h[:_HEADER_DIMS] if int(d) >= 0]
            return f"{dims[0]} rows of shape {tuple(dims[1:])}, {int(h[_HEADER_DIMS])}-byte elements"

        raise TransferPlanError(
            f"the transfer's two sides do not move the same rows: the source packs {describe(src)}, "
            f"the destination's pool takes {describe(dst)} (dtype codes {int(src[-1])} / {int(dst[-1])}); "
            f"prefill and decode pools must hold the same row format (latent and rope columns, dtype, "
            f"fp8 packing)"
        )
