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
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Tuple

import torch

__all__ = [
    "AttentionCall",
    "CallShape",
    "Causal",
    "Parts",
    "as_causal",
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


def as_causal(causal) -> Optional[Causal]:
    """None, a ``Causal`` or a plain ``(q_pos, cp_world, cp_rank)`` tuple -> ``Optional[Causal]``."""
    if causal is None or isinstance(causal, Causal):
        return causal
    return Causal(*causal)


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
        q, kv = call.q_lat, call.kv
        B, S, H, _ = q.shape
        device = kv.device
        parts = call.parts()
        fused = call.pe is None
        d_main = parts.q_main.shape[-1]
        d_tail = parts.q_tail.shape[-1] if parts.q_tail is not None else 0
        T = call.page_table.shape[1] * call.page_size if call.paged else kv.shape[1]
        mask = "none"
        if call.mask is not None:
            mask = "full"
            try:
                strides = torch.broadcast_to(call.mask, (B, S, H, T)).stride()
                if call.mask.device == device and mask_rows_shared(strides, S):
                    mask = "row"
            except RuntimeError:  # not broadcastable: the kernels' own checks report it
                pass
        tensors = [t for t in (parts.q_main, parts.q_tail, parts.k_main, parts.k_tail) if t is not None]
        dtypes = {t.dtype for t in (q, call.q_rope, kv, call.pe) if t is not None}
        aligned = all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(x % 8 == 0 for x in t.stride()[:-1])
                      for t in tensors)
        is_cuda = kv.is_cuda
        return cls(
            device="cuda" if is_cuda else device.type,
            capability=_capability(device.index if device.index is not None else torch.cuda.current_device())
            if is_cuda else None,
            triton=_triton_version(), dtype=kv.dtype, same_dtypes=len(dtypes) == 1,
            batch=B, tokens=S, heads=H, keys=T, d_main=d_main, d_tail=d_tail, v_dim=call.v_dim, fused=fused,
            mask=mask, causal=call.causal is not None, paged=call.paged, lens=call.kv_lens is not None,
            gluon_aligned=aligned, rows16=all(x % 16 == 0 for t in tensors for x in t.stride()[:-1]),
        )

    def describe(self) -> str:
        """One line for reasons and test ids."""
        return (f"{self.device} sm{self.capability} {str(self.dtype).replace('torch.', '')} B={self.batch} "
                f"S={self.tokens} H={self.heads} T={self.keys} {self.d_main}+{self.d_tail} v={self.v_dim} "
                f"{'fused' if self.fused else 'two caches'} {self.kind}{' paged' if self.paged else ''}")


@dataclass(frozen=True)
class AttentionCall:
    """The operands of one shard-local MLA attention call (shapes in ``kernels/mla_attention.py``).

    ``kv`` and ``pe`` are the page pools when ``page_table`` is given (``page_size`` = pool
    rows per page). ``kv_lens`` are this shard's key counts, or with ``lens_stripe=(c, r)``
    global counts of which rank r of c holds ``(n + c - 1 - r) // c``. ``causal`` is stored as
    a :class:`Causal` (a plain 3-tuple is converted).
    """

    q_lat: torch.Tensor
    q_rope: Optional[torch.Tensor]
    kv: torch.Tensor
    pe: Optional[torch.Tensor]
    v_dim: int
    scale: float
    mask: Optional[torch.Tensor] = None
    kv_lens: Optional[torch.Tensor] = None
    lse_base: str = "e"
    causal: Optional[Causal] = None
    page_table: Optional[torch.Tensor] = None
    page_size: int = 1
    lens_stripe: Tuple[int, int] = (1, 0)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "causal", as_causal(self.causal))
        check_base(self.lse_base)

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    def parts(self) -> Parts:
        if "parts" not in self._cache:
            self._cache["parts"] = split_parts(self.q_lat, self.q_rope, self.kv, self.pe, self.v_dim)
        return self._cache["parts"]

    @property
    def shape(self) -> CallShape:
        """What a kernel chooser sees of this call (computed once)."""
        if "shape" not in self._cache:
            self._cache["shape"] = CallShape.of(self)
        return self._cache["shape"]

    def but(self, **changes) -> "AttentionCall":
        """This call with some operands changed."""
        return replace(self, _cache={}, **changes)
