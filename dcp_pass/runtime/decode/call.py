"""The operands of one shard-local attention call, and what a kernel chooser sees of them.

:class:`AttentionCall` is built once per call and handed to every entry point (the torch
reference, each kernel, the registry's chooser); :class:`CallShape` is its description in
plain numbers and flags (devices, dtypes, sizes, the kind of mask, alignment), from which
each kernel of ``kernels/registry.py`` says whether it can run the call and the chooser
picks one. A chooser therefore needs no tensors: tests describe calls directly.

Pure torch: importing this module imports no kernel and no Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import NamedTuple, Optional, Tuple, Union

import torch

__all__ = [
    "KV_SCALE_BLOCK",
    "AttentionCall",
    "CallShape",
    "ShardView",
    "Causal",
    "Parts",
    "check_base",
    "mask_rows_shared",
    "pow2",
    "split_parts",
]


class Causal(NamedTuple):
    """Causal visibility on a DCP shard: local key k (global position ``k * cp_world + cp_rank``)
    is visible to a query at global position ``q_pos[b, s]`` when that position is not before it."""

    q_pos: torch.Tensor  # [B, S] (or broadcastable), integer global query positions
    cp_world: int
    cp_rank: int


@dataclass(frozen=True)
class Parts:
    """Where the two score terms live: 'main' (also the values) and 'tail' (rope)."""

    q_main: torch.Tensor  # [B, S, H, Dm]
    k_main: torch.Tensor  # [B, T, Dm]  (a column slice of kv)
    q_tail: Optional[torch.Tensor]  # [B, S, H, Dt]
    k_tail: Optional[torch.Tensor]  # [B, T, Dt]


def check_base(lse_base) -> str:
    base = str(lse_base)
    if base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
    return base


def split_parts(q_lat, q_rope, kv, pe, v_dim) -> Parts:
    """The score terms of an MLA call (fused cache when ``pe`` is None), with the checks
    that say which operand does not fit."""
    if q_lat.dim() != 4:
        raise ValueError(f"q_lat must be [B, S, H, D], got shape {tuple(q_lat.shape)}")
    if kv.dim() != 3:
        raise ValueError(f"kv must be [B, T, Dk], got shape {tuple(kv.shape)}")
    dl = q_lat.shape[-1]
    if pe is None:
        if q_rope is not None:
            raise ValueError("q_rope given but pe is None: a fused cache needs the rope part inside q_lat")
        if kv.shape[-1] < dl:
            raise ValueError(f"fused cache has {kv.shape[-1]} columns, q_lat needs {dl}")
        if not 0 < v_dim <= dl:
            raise ValueError(f"v_dim={v_dim} must be in (0, {dl}] for a fused cache")
        # fused: the first v_dim columns are latent (keys and values), the rest rope
        q_main, k_main = q_lat[..., :v_dim], kv[..., :v_dim]
        if dl > v_dim:
            q_tail, k_tail = q_lat[..., v_dim:], kv[..., v_dim:dl]
        else:
            q_tail = k_tail = None
    else:
        if q_rope is None:
            raise ValueError("pe given but q_rope is None")
        if kv.shape[-1] < dl:
            raise ValueError(f"kv has {kv.shape[-1]} columns, q_lat needs {dl}")
        if q_rope.shape[-1] != pe.shape[-1]:
            raise ValueError(f"q_rope dim {q_rope.shape[-1]} != pe dim {pe.shape[-1]}")
        if not 0 < v_dim <= kv.shape[-1]:
            raise ValueError(f"v_dim={v_dim} must be in (0, {kv.shape[-1]}]")
        q_main, k_main = q_lat, kv[..., :dl]
        q_tail, k_tail = (q_rope, pe) if pe.shape[-1] > 0 else (None, None)
    return Parts(q_main, k_main, q_tail, k_tail)


def pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (int(n) - 1)).bit_length())


def mask_rows_shared(strides, S: int) -> bool:
    """Whether a [B, S, H, T] mask with these strides is one row per request: the same for
    every head, and for every query token too unless there is one."""
    return strides[2] == 0 and (S == 1 or strides[1] == 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _triton_version() -> str:
    try:
        import triton
    except Exception:  # pragma: no cover - exercised only without triton
        return ""
    return triton.__version__


@dataclass(frozen=True)
class CallShape:
    """What a kernel chooser sees of an attention call: plain numbers and flags.

    Built from a call by :meth:`AttentionCall.shape`, or directly in tests of the chooser.
    ``mask``: "none"; "row" (one additive row per request serves every head and query token,
    on the caches' device: a decode step's mask); "full" (any other). ``gluon_aligned``: the
    four score operands have unit feature stride, 16-byte aligned data and row strides that
    are multiples of 8 elements; ``rows16``: their row strides are multiples of 16 elements.
    """

    device: str = "cuda"
    capability: Optional[int] = 9  # major compute capability of the CUDA device, None elsewhere
    triton: str = "3.6.0"  # the Triton version ('' without Triton)
    dtype: torch.dtype = torch.bfloat16  # the caches' dtype
    same_dtypes: bool = True  # queries and caches of one dtype
    batch: int = 1
    tokens: int = 1  # query tokens per request
    heads: int = 128
    keys: int = 4096  # key rows the kernel spans (a shard's rows, or pages x page size)
    d_main: int = 512  # score columns of the main term (the values' columns come first)
    d_tail: int = 64  # score columns of the rope term (0: none)
    v_dim: int = 512
    fused: bool = True  # one cache holds latent and rope columns
    mask: str = "none"
    causal: bool = False
    paged: bool = False
    lens: bool = True  # device key counts
    gluon_aligned: bool = True
    rows16: bool = True
    per_head: bool = False  # per-head keys and values (GQA / MHA), not an MLA latent cache
    offset_lens: bool = False  # device key counts over caches that start past row 0 (a window)
    # "fp8_e4m3": the latent cache is float8 with per-128-column fp32 scales (call.kv_scale);
    # then ``dtype`` is the latent's float8 dtype and ``query_dtype`` that of the queries and rope
    kv_quant: str = ""
    query_dtype: Optional[torch.dtype] = None
    # the key counts are known on the host without reading the device (none, host ints, or
    # the step's count the backend holds: AttentionCall.host_lens)
    host_lens: bool = False

    @property
    def rows(self) -> int:
        """(query token, head) rows of one request."""
        return self.tokens * self.heads

    @property
    def kind(self) -> str:
        """The measured kind of call (kernels/path_table.py): a causal cap outweighs a mask."""
        return "causal" if self.causal else "mask" if self.mask != "none" else "plain"

    @classmethod
    def of(cls, call: "AttentionCall") -> "CallShape":
        view = call.shard()
        q, kv = view.q_lat, view.kv
        B, S, H, _ = q.shape
        device = kv.device
        T = view.page_table.shape[1] * view.page_size if view.paged else kv.shape[1]
        if view.v is not None:  # per-head keys and values: no MLA parts
            d_main, d_tail, fused, tensors = q.shape[-1], 0, False, [q, kv, view.v]
        else:
            parts = view.parts()
            d_main = parts.q_main.shape[-1]
            d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
            fused = view.pe is None
            tensors = [t for t in (parts.q_main, parts.q_tail, parts.k_main, parts.k_tail) if t is not None]
        mask = "none"
        if view.mask is not None:
            mask = "full"
            try:
                strides = torch.broadcast_to(view.mask, (B, S, H, T)).stride()
                if view.mask.device == device and mask_rows_shared(strides, S):
                    mask = "row"
            except RuntimeError:  # not broadcastable: the kernels' own checks report it
                pass
        # an fp8 latent is read with its scales into the queries' dtype: the others must agree
        dtypes = {
            t.dtype
            for t in (q, view.q_rope, None if view.kv_scale is not None else kv, view.pe, view.v)
            if t is not None
        }
        aligned = all(
            t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(x % 8 == 0 for x in t.stride()[:-1]) for t in tensors
        )
        is_cuda = kv.is_cuda
        return cls(
            device="cuda" if is_cuda else device.type,
            capability=_capability(device.index if device.index is not None else torch.cuda.current_device())
            if is_cuda
            else None,
            triton=_triton_version(),
            dtype=kv.dtype,
            same_dtypes=len(dtypes) == 1,
            batch=B,
            tokens=S,
            heads=H,
            keys=T,
            d_main=d_main,
            d_tail=d_tail,
            v_dim=view.v_dim,
            fused=fused,
            mask=mask,
            causal=view.causal is not None,
            paged=view.paged,
            lens=view.kv_lens is not None,
            gluon_aligned=aligned,
            rows16=all(x % 16 == 0 for t in tensors for x in t.stride()[:-1]),
            per_head=view.v is not None,
            offset_lens=view.first_row > 0 and view.kv_lens is not None,
            kv_quant="fp8_e4m3" if view.kv_scale is not None else "",
            query_dtype=q.dtype,
            host_lens=view.host_lens is not None
            or not (isinstance(view.kv_lens, torch.Tensor) and view.kv_lens.device.type != "cpu"),
        )

    def describe(self) -> str:
        """One line for reasons and test ids."""
        layout = "per-head K/V" if self.per_head else "fused" if self.fused else "two caches"
        dtype = str(self.dtype).replace("torch.", "") + (f" ({self.kv_quant} latent)" if self.kv_quant else "")
        return (
            f"{self.device} sm{self.capability} {dtype} B={self.batch} "
            f"S={self.tokens} H={self.heads} T={self.keys} {self.d_main}+{self.d_tail} v={self.v_dim} "
            f"{layout} {self.kind}{' paged' if self.paged else ''}"
        )


@dataclass(frozen=True)
class AttentionCall:
    """The operands of one shard-local attention call, stated once, in one convention.

    **Numbers and masks are global, the caches are the rank's own.** ``kv`` / ``pe`` (or the
    page pools, with ``page_table``) hold rank ``r``'s stripe of ``c`` (``stripe=(c, r)``):
    local row ``i`` is global position ``i * c + r``. Everything else speaks of global
    positions: ``kv_lens`` is the global key count (a host int, or an int tensor ``[1]`` /
    ``[B]`` on the query's device), ``kv_start`` the first visible global key (a sliding
    window), ``q_pos`` the causal cap (global query positions ``[B, S]``; a key is visible
    to a query at or after it) and ``mask`` an additive (or boolean, True: visible) mask over
    the global key positions ``kv_start, kv_start + 1, ...`` (last dim, or 1 to broadcast). The call derives the
    rank's view of all that once (:meth:`shard`): its visible rows, its mask columns, its
    share of the counts.

    Why global: every caller has them so. The compiled graph may hold only values that are
    the same on every rank (a rank-local count or a striped mask has a rank-dependent size,
    and a guard on it would make one rank recompile where another does not), extend and
    speculative verification count their keys and queries in global positions, and the
    kernels take a rank's share of a device count themselves, with no torch op per call
    (which keeps the op's launches replayable).

    ``host_lens``: the global count a device ``kv_lens`` holds, when the host knows it without
    reading the device (a decode graph's step count, runtime/decode/step_count.py): kernels
    that plan on the host read it instead of syncing.

    ``kv_lens=None``: every row of the caches is a key. ``v`` (per-head values
    ``[B, T, Hk, Dv]``, with ``kv`` then per-head keys ``[B, T, Hk, D]`` and ``q_rope`` /
    ``pe`` None): grouped-query / multi-head attention, query head h reading kv head
    ``h // (H // Hk)``; otherwise MLA (shapes in ``kernels/mla_attention.py``: values are
    ``kv[..., :v_dim]``, ``pe`` None means a fused cache).
    """

    q_lat: torch.Tensor
    q_rope: Optional[torch.Tensor]
    kv: torch.Tensor
    pe: Optional[torch.Tensor]
    v_dim: int
    scale: float
    mask: Optional[torch.Tensor] = None
    q_pos: Optional[torch.Tensor] = None
    kv_lens: Union[None, int, torch.Tensor] = None
    kv_start: int = 0
    stripe: Tuple[int, int] = (1, 0)
    lse_base: str = "e"
    page_table: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    kv_scale: Optional[torch.Tensor] = None
    host_lens: Optional[int] = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        check_base(self.lse_base)
        if self.kv_scale is not None:
            check_fp8_operands(self)
        elif not self.kv.dtype.is_floating_point:
            # packed fp8 rows (uint8) read as numbers would give finite garbage
            raise ValueError(
                f"the cache is {str(self.kv.dtype).replace('torch.', '')}, not a float: a packed fp8 shard "
                f"(kv_cache_dtype='fp8_e4m3') is read through kv_format.views(rows, layout) as kv (its e4m3 "
                f"latent), kv_scale (its scales) and pe (its rope columns)"
            )
        from dcp_pass.runtime.decode.layout import _check_rank

        if len(self.stripe) != 2:
            raise ValueError(f"stripe must be (c, r), got {self.stripe!r}")
        _check_rank(*self.stripe)
        if not isinstance(self.kv_start, int) or self.kv_start < 0:
            raise ValueError(f"kv_start must be an int >= 0, got {self.kv_start!r}")
        if isinstance(self.kv_lens, bool) or not (
            self.kv_lens is None or isinstance(self.kv_lens, (int, torch.Tensor))
        ):
            raise ValueError(f"kv_lens must be None, an int or an int tensor, got {self.kv_lens!r}")
        if isinstance(self.kv_lens, int) and not self.kv_start <= self.kv_lens:
            raise ValueError(
                f"the window must satisfy 0 <= kv_start <= kv_lens, got kv_start={self.kv_start}, "
                f"kv_lens={self.kv_lens}"
            )
        if self.host_lens is not None and not (isinstance(self.kv_lens, torch.Tensor) and self.kv_lens.numel() == 1):
            raise ValueError(
                f"host_lens is the host's copy of a one-element kv_lens tensor; this call's kv_lens is {self.kv_lens!r}"
            )
        if self.paged and (self.kv_start or not isinstance(self.kv_lens, torch.Tensor)):
            raise ValueError("a paged call takes its key counts as a tensor (kv_lens) and no window (kv_start=0)")
        if self.v is not None and (self.q_rope is not None or self.pe is not None or self.paged):
            raise ValueError(
                "per-head values (v) take one query tensor and one key tensor: q_rope, pe and page_table must be None"
            )

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def per_head(self) -> bool:
        return self.v is not None

    def shard(self) -> "ShardView":
        """The call as the rank's kernels read it (computed once)."""
        if "shard" not in self._cache:
            self._cache["shard"] = ShardView.of(self)
        return self._cache["shard"]

    def parts(self) -> Parts:
        return self.shard().parts()

    @property
    def shape(self) -> CallShape:
        """What a kernel chooser sees of this call (computed once)."""
        if "shape" not in self._cache:
            self._cache["shape"] = CallShape.of(self)
        return self._cache["shape"]

    def replace(self, **changes) -> "AttentionCall":
        """This call with some operands changed."""
        return _replace(self, _cache={}, **changes)


KV_SCALE_BLOCK = 128  # latent columns per scale of an fp8 cache (kv_format.SCALE_BLOCK)


def check_fp8_operands(call: "AttentionCall") -> None:
    """An fp8 latent cache's operands: fp8 rows, fp32 scales of matching rows, 16-bit rope."""
    kv, ks = call.kv, call.kv_scale
    if call.v is not None:
        raise ValueError("kv_scale (an fp8 latent cache) is for MLA calls, not per-head keys and values")
    if kv.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_scale given, so kv must be a float8_e4m3fn latent cache; got {kv.dtype}")
    if ks.dtype != torch.float32:
        raise ValueError(f"kv_scale must be float32, got {ks.dtype}")
    want = tuple(kv.shape[:-1]) + (-(-kv.shape[-1] // KV_SCALE_BLOCK),)
    if tuple(ks.shape) != want:
        raise ValueError(
            f"kv_scale must be {list(want)} (one scale per {KV_SCALE_BLOCK} columns of each kv row), "
            f"got {list(ks.shape)}"
        )
    if ks.device != kv.device:
        raise ValueError("kv_scale must be on kv's device")


def _local_length(n, c: int, r: int):
    """Positions of rank r of c below global position n (layout.local_length, without its checks)."""
    return (n + (c - 1 - r)) // c


@dataclass(frozen=True)
class ShardView:
    """An :class:`AttentionCall` as rank r's kernels read it.

    ``kv`` / ``pe`` / ``v``: the caches from the rank's first visible row, ``first_row`` =
    its positions before ``kv_start`` (so local row k here is global position
    ``(first_row + k) * c + r``) and, for a host count, up to its last visible row;
    ``mask``: the rank's columns of the call's mask, one per row here; ``kv_lens``: the
    device counts, global (``lens_stripe`` tells the kernels to take rank r's share) or
    None (every row here is a key); ``causal``: the cap in the kernels' form
    ``(q_pos, c, r + first_row * c)``.
    """

    q_lat: torch.Tensor
    q_rope: Optional[torch.Tensor]
    kv: torch.Tensor
    pe: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    v_dim: int
    scale: float
    mask: Optional[torch.Tensor]
    kv_lens: Optional[torch.Tensor]
    causal: Optional[Causal]
    lens_stripe: Tuple[int, int]
    first_row: int
    lse_base: str
    page_table: Optional[torch.Tensor]
    page_size: int
    kv_scale: Optional[torch.Tensor] = None  # the fp8 latent's scales, rows as kv's
    host_lens: Optional[int] = None  # the host's copy of a device kv_lens (AttentionCall.host_lens)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    def parts(self) -> Parts:
        if "parts" not in self._cache:
            if self.v is not None:
                raise ValueError("per-head keys and values have no MLA score parts")
            self._cache["parts"] = split_parts(self.q_lat, self.q_rope, self.kv, self.pe, self.v_dim)
        return self._cache["parts"]

    @classmethod
    def of(cls, call: AttentionCall) -> "ShardView":
        c, r = call.stripe
        first = _local_length(call.kv_start, c, r)
        kv, pe, v, mask, lens, ks = call.kv, call.pe, call.v, call.mask, call.kv_lens, call.kv_scale
        page_size = kv.shape[1] if call.paged else 1
        if not call.paged:
            if kv.dim() < 3:
                raise ValueError(f"kv must be [B, T, Dk] (or [B, T, Hk, D] with v), got shape {tuple(kv.shape)}")
            end = None
            if isinstance(lens, int):
                end = _local_length(lens, c, r)
                if kv.shape[1] < end:
                    raise ValueError(
                        f"the caches have {kv.shape[1]} local rows, rank {r} of {c} owns {end} "
                        f"positions below kv_lens={lens}"
                    )
                lens = None
            if v is not None and v.shape[1] < (end if end is not None else kv.shape[1]):
                raise ValueError(f"v has {v.shape[1]} local rows, the keys {kv.shape[1]}")
            if first or end is not None:
                rows = slice(first, end)
                kv = kv[:, rows]
                pe = pe[:, rows] if pe is not None else None
                v = v[:, rows] if v is not None else None
                ks = ks[:, rows] if ks is not None else None
        if mask is not None and mask.shape[-1] != 1:
            if isinstance(call.kv_lens, int) and mask.shape[-1] != call.kv_lens - call.kv_start:
                raise ValueError(
                    f"the mask's last dim is {mask.shape[-1]}; it must cover the visible global key "
                    f"positions [kv_start, kv_lens) = [{call.kv_start}, {call.kv_lens}) "
                    f"({call.kv_lens - call.kv_start}), or be 1 to broadcast"
                )
            # global column j is position kv_start + j: the rank's first is column (r - kv_start) mod c
            mask = mask[..., (r - call.kv_start) % c :: c] if c > 1 else mask
        causal = None if call.q_pos is None else Causal(call.q_pos, c, r + first * c)
        host = call.host_lens if isinstance(lens, torch.Tensor) else None
        return cls(
            call.q_lat,
            call.q_rope,
            kv,
            pe,
            v,
            call.v_dim,
            call.scale,
            mask,
            lens,
            causal,
            (c, r),
            first,
            call.lse_base,
            call.page_table,
            page_size,
            ks,
            host,
        )
