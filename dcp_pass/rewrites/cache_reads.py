"""Cache tensors of a captured graph, and how the graph reads and writes them.

A *cache tensor* is a graph input that holds one row per token position: a module
buffer `[batch, position, feature]` (DeepSeek's reference code), the same with a
singleton head axis `[batch, position, 1, feature]` or `[batch, 1, position, feature]`
(one latent "kv head", MQA style). Its layout is a tuple of axis roles: B (batch),
T (position), F (feature) and None for a singleton head axis that broadcasts over the
query heads.

A *read* is any chain of views from the cache tensor to an operand of the attention:
slices of the batch, position and feature axes, permutes and transposes, unsqueeze,
expand over heads, singleton views, dtype casts, and `torch.cat` of several reads along
the feature axis (keys built as latent || rotary from two caches), in any order. The
tracer replays the chain from the cache tensor forward, so the result does not depend
on the order in which the model wrote its views: what it keeps is the cache tensor,
the rows, positions and columns read, and the role of each axis of the operand.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.fx as fx

from dcp_pass.rewrites import axes, fx_util
from dcp_pass.rewrites.axes import B, F, T
from dcp_pass.runtime.decode import layout

SizeArg = Union[int, fx.Node]
BUFFER_SOURCE = re.compile(r"_buffers\[")
MAX_CHAIN = 48  # views between a cache tensor and an attention operand


# ----------------------------------------------------------------------------- cache tensors


def buffer_source(node: fx.Node) -> Optional[str]:
    """Dynamo's source name of a placeholder (e.g. L['self']._modules['attn']._buffers['kv_cache'])."""
    return fx_util.dynamo_source_name(node)


def module_path(source: Optional[str]) -> str:
    """`L['self']._modules['layers']._modules['0']._modules['attn']._buffers['kv_cache']` -> `layers.0.attn.kv_cache`.

    The keys of the source's subscripts, without the frame's own `self` and without the
    `fn` of a decorated forward (Dynamo traces `inference_mode()(forward)` as a call of
    the wrapped function, whose module argument is then named after the wrapper's `fn`).
    """
    if not source:
        return "?"
    keys = re.findall(r"\['([^']*)'\]", source)
    # attributes and list indices after the last subscript: a graph input reached through
    # an object (`L['kwargs']['cache'].layers[0].keys`, a Hugging Face cache) -> cache.layers.0.keys
    tail = source[source.rfind("']") + 2 :] if "']" in source else ""
    attrs = re.findall(r"\.(\w+)|\[(\d+)\]", tail)
    if attrs and keys:
        keys = [k for k in keys if k not in ("kwargs", "args")] + [a or i for a, i in attrs]
    while keys and keys[0] in ("self", "fn"):
        keys = keys[1:]
    return ".".join(keys) or source


@dataclass(frozen=True)
class CacheKind:
    """One kind of cache: how its tensors are found, read, written and striped. One record per
    kind, each in its own module of rewrites/cache_kinds/, listed in that package's table
    (`cache_kinds()`); every read (CacheRead.kind) and write (CacheAccess.kind) holds its record.
    Records are compared by identity: the name is for messages and tests."""

    name: str
    words: str  # the kind in a user's terms, for messages
    # its run-time half (a state.store.ShardKind, from state/shards.py): the shard, and what eager
    # code may do with a striped tensor
    shards: Any
    # (graph, this rank's shard node, the read, node name, c) -> the rank's rows [batch, position,
    # feature] of the read; None: the kind's own rewrite reads its shards (recognisers/per_head.py)
    local_read: Optional[Callable[..., fx.Node]]
    # graph input -> its axis roles when it is a cache tensor of this kind (else None); None: the
    # kind's tensors are told apart by how they are read, not by the input (a paged pool)
    layout: Optional[Callable[[fx.Node], Optional[tuple]]] = None
    # node -> the `_Piece` a read of this kind starts at (a paged pool's gather), else None
    read_base: Optional[Callable[[fx.Node], Optional["_Piece"]]] = None
    # node -> the CacheAccess when it writes a cache tensor in a form of this kind, else None
    write_form: Optional[Callable[[fx.Node], Optional["CacheAccess"]]] = None
    # (the kind a write was matched as, how it reads as a write of this kind, or None where it
    # means something else here)
    write_conversions: tuple[tuple["CacheKind", Callable[["CacheAccess"], Optional["CacheAccess"]]], ...] = ()
    # (a read of this kind, c) -> why it cannot be striped over c ranks, or None
    stripe_check: Optional[Callable[["CacheRead", int], Optional[str]]] = None
    layer_note: str = ""  # added to the report's line of a layer that reads it
    # a kind whose shard rows are not striped by position (a window ring kept whole, then
    # striped entries): (graph, the score mask over the read's rows or None, the read, c, rank,
    # whether the mask is boolean) -> (the mask over the shard's rows, their count); the local
    # attention then attends the shard's rows as they are. None: rows by position (the op keeps
    # the rank's stripe of the global mask)
    shard_mask: Optional[Callable[..., tuple[fx.Node, int]]] = None


_KINDS: tuple[CacheKind, ...] = ()


def install_kinds(kinds: tuple[CacheKind, ...]) -> None:
    """Hand the tracer the kinds' table (rewrites/cache_kinds/ does, as it is imported: the
    kinds build on this module, so this module cannot import them)."""
    global _KINDS
    _KINDS = tuple(kinds)


def cache_kinds() -> tuple[CacheKind, ...]:
    """Every cache kind, in the order their layouts and forms are tried (rewrites/cache_kinds/'s
    table, installed when the rewrites package is imported)."""
    if not _KINDS:
        raise RuntimeError(
            "dcp_pass.rewrites.cache_reads: no cache kinds installed (dcp_pass.rewrites.cache_kinds "
            "installs them when imported)"
        )
    return _KINDS


def tensor_kind(node: Any) -> Optional[tuple[CacheKind, tuple[Optional[str], ...]]]:
    """The kind whose layout knows the cache tensor placeholder `node` (the first that does) and
    the axis roles it gives, or None when `node` is not one."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    for kind in cache_kinds():
        layout = kind.layout(node) if kind.layout else None
        if layout is not None:
            return kind, layout
    return None


def cache_layout(node: Any) -> Optional[tuple[Optional[str], ...]]:
    """Axis roles of a cache tensor placeholder (as the first kind that knows it says), or None
    when `node` is not one."""
    found = tensor_kind(node)
    return found[1] if found is not None else None


def module_buffer_layout(node: fx.Node) -> Optional[tuple[Optional[str], ...]]:
    """Axis roles of a module buffer placeholder that is a cache tensor, else None.

    Module buffers of rank 3 are `[batch, position, feature]`; of rank 4, the singleton
    axis next to the position axis is a head axis of size 1 (`[B, T, 1, F]` or `[B, 1, T, F]`).
    """
    name = buffer_source(node)
    shape = axes.shape_of(node)
    if not (name and BUFFER_SOURCE.search(name)) or shape is None:
        return None
    if len(shape) == 3:
        return (B, T, F)
    if len(shape) == 4:
        one = [axes.known_equal(shape[i], 1) for i in (1, 2)]
        if one == [False, True]:
            return (B, T, None, F)
        if one == [True, False]:
            return (B, None, T, F)
    return None


def is_cache_tensor(node: Any) -> bool:
    return cache_layout(node) is not None


def position_axis(buffer: fx.Node) -> int:
    return cache_layout(buffer).index(T)


def buffer_name(buffer: fx.Node) -> str:
    """The user's name of a cache tensor (`layers.0.attn.kv_cache`)."""
    return module_path(buffer_source(buffer))


# ----------------------------------------------------------------------------- reads


@dataclass
class CacheRead:
    """What one attention operand (or one feature piece of it) reads of a cache tensor.

    `buffer[row0:bsz, start:end, feat]` in the cache tensor's own axes (`row0` is 0 unless
    the read takes rows further down the batch: one request's prefill); `roles` gives the role
    of each axis of the operand `node` (B, T, F, or None for a head axis of size 1 or
    expanded over the query heads). `cols` is where this piece sits in the operand's
    feature axis (keys concatenated from several caches), None for the whole axis.
    """

    node: fx.Node
    buffer: fx.Node
    bsz: SizeArg
    start: SizeArg
    end: SizeArg
    feat: Optional[tuple[int, int]]  # absolute feature columns of the cache tensor, None = all
    roles: list[Optional[str]]
    cols: Optional[tuple[int, int]] = None
    pages: Optional[fx.Node] = None  # a paged pool's block table (rows: requests, columns: pages)
    page_size: Optional[int] = None
    row0: SizeArg = 0  # the first batch row read
    # how the read starts: the kind whose read base it starts at (a paged pool's gather), else
    # the kind whose layout knows the cache tensor
    kind: Optional[CacheKind] = None

    @property
    def width(self) -> int:
        f0, f1 = self.feat or (0, axes.shape_of(self.buffer)[-1])
        return f1 - f0

    @property
    def windowed(self) -> bool:
        return not (isinstance(self.start, int) and self.start == 0)


class ReadRefused(Exception):
    """A view of a cache tensor that the tracer cannot follow; the message says which."""


@dataclass
class _Axis:
    """One axis of a tensor on the way from a cache tensor: the cache axis it shows (None: new)."""

    source: Optional[int]


@dataclass
class _Piece:
    """Replay state of one cache tensor on its way to the operand.

    `layout` / `shape` describe the tensor the axes' sources index: the cache tensor
    itself, or for a paged pool the gathered pages (see rewrites/cache_kinds/paged.py).
    """

    buffer: fx.Node
    dims: list[_Axis]
    bounds: dict[int, tuple[SizeArg, Optional[SizeArg]]]  # source axis -> [start, stop) (None: to the end)
    cols: Optional[tuple[int, int]]  # columns of the operand's feature axis this piece fills
    layout: tuple = ()
    shape: tuple = ()
    pages: Optional[fx.Node] = None
    page_size: Optional[int] = None
    merges: dict[tuple[int, int], int] = None  # (source a, source b) -> the source of the two axes merged
    kind: Optional[CacheKind] = None  # the kind that makes the read's base (CacheRead.kind)

    def __post_init__(self):
        if not self.layout:
            self.kind, self.layout = tensor_kind(self.buffer)
            self.shape = tuple(axes.shape_of(self.buffer))
        self.merges = self.merges or {}


def _add(a: SizeArg, b: SizeArg) -> SizeArg:
    if isinstance(a, int) and a == 0:
        return b
    if isinstance(b, int) and b == 0:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    raise ReadRefused("two offsets of the same cache axis are added symbolically")


def _extent(piece: _Piece, axis: int) -> Optional[SizeArg]:
    """Current size of cache axis `axis` after the bounds applied so far (None: unknown symbolic)."""
    start, stop = piece.bounds.get(axis, (0, None))
    full = piece.shape[axis]
    stop = full if stop is None else stop
    if isinstance(start, int) and isinstance(stop, int):
        return stop - start
    if isinstance(start, int) and start == 0:
        return stop
    return None


def _apply_slice(piece: _Piece, dim: int, index: slice) -> None:
    if index.step not in (None, 1):
        raise ReadRefused("a strided slice of a cache tensor")
    source = piece.dims[dim].source
    start = 0 if index.start is None else index.start
    stop = index.stop
    if source is None:  # a new or broadcast axis: only a no-op slice keeps its meaning
        if isinstance(start, int) and start == 0:
            return
        raise ReadRefused("a broadcast axis of a cache read is sliced")
    extent = _extent(piece, source)
    if isinstance(start, int) and start < 0 or isinstance(stop, int) and stop < 0:
        if not isinstance(extent, int):
            raise ReadRefused("a negative slice of a symbolic cache axis")
        start = start + extent if isinstance(start, int) and start < 0 else start
        stop = stop + extent if isinstance(stop, int) and stop < 0 else stop
    if isinstance(stop, int) and isinstance(extent, int):
        stop = min(stop, extent)
    old_start, old_stop = piece.bounds.get(source, (0, None))
    new_start = _add(old_start, start)
    new_stop = old_stop if stop is None else _add(old_start, stop)
    piece.bounds[source] = (new_start, new_stop)


def _feature_dim(piece: _Piece) -> int:
    layout = piece.layout
    return next(i for i, d in enumerate(piece.dims) if d.source is not None and layout[d.source] == F)


def _slice_feature(pieces: list[_Piece], index: slice, width: int) -> list[_Piece]:
    """A slice of the operand's feature axis: keep the pieces it covers, trimmed."""
    if index.step not in (None, 1):
        raise ReadRefused("a strided slice of the feature axis")
    start = 0 if index.start is None else index.start
    stop = width if index.stop is None else index.stop
    if not (isinstance(start, int) and isinstance(stop, int)):
        raise ReadRefused("a symbolic slice of the feature axis")
    start, stop = (start + width if start < 0 else start), (stop + width if stop < 0 else min(stop, width))
    kept = []
    for piece in pieces:
        c0, c1 = piece.cols or (0, width)
        lo, hi = max(c0, start), min(c1, stop)
        if lo >= hi:
            continue
        dim = _feature_dim(piece)
        _apply_slice(piece, dim, slice(lo - c0, hi - c0))
        piece.cols = (lo - start, hi - start)
        kept.append(piece)
    if len(kept) == 1 and kept[0].cols == (0, stop - start):
        kept[0].cols = None
    return kept


def _index_entries(index: Any, rank: int) -> list[Any]:
    """A getitem index as one entry per input axis (Ellipsis expanded), None entries kept."""
    entries = list(index) if isinstance(index, tuple) else [index]
    real = sum(1 for e in entries if e is not None and e is not Ellipsis)
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries[at : at + 1] = [slice(None)] * (rank - real)
    return entries + [slice(None)] * (rank - sum(1 for e in entries if e is not None))


def _is_singleton(piece: _Piece, dim: int, node_shape: tuple) -> bool:
    return axes.known_equal(node_shape[dim], 1)


class _Replay:
    """Replays the ops of a view chain on the pieces it is built from."""

    def __init__(self, pieces: list[_Piece]):
        self.pieces = pieces

    def width(self, src: fx.Node) -> int:
        return axes.shape_of(src)[-1] if self.pieces else 0

    def step(self, node: fx.Node, src: fx.Node) -> None:
        src_shape = axes.shape_of(src)
        shape = axes.shape_of(node)
        if src_shape is None or shape is None:
            raise ReadRefused("a view without a traced shape")
        if node.op == "call_function" and node.target is operator.getitem:
            self._getitem(node.args[1], src_shape)
            return
        if axes.is_method(node, "narrow") or axes.is_function(node, torch.narrow):
            dim, start, length = node.args[1:4]
            dim = axes.normalize_dim(dim, len(src_shape))
            self._getitem(tuple([slice(None)] * dim + [slice(start, _add(start, length))]), src_shape)
            return
        if axes.is_method(node, "squeeze") or axes.is_function(node, torch.squeeze):
            dims = node.args[1:] if node.op == "call_method" else node.args[1:]
            if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
                dims = tuple(dims[0])
            dims = [axes.normalize_dim(d, len(src_shape)) for d in dims] or [
                i for i in range(len(src_shape)) if axes.known_equal(src_shape[i], 1)
            ]
            for piece in self.pieces:
                piece.dims = [
                    d for i, d in enumerate(piece.dims) if not (i in dims and axes.known_equal(src_shape[i], 1))
                ]
            return
        if axes.is_method(node, "select") or axes.is_function(node, torch.select):
            dim, index = node.args[1:3]
            self._getitem(tuple([slice(None)] * axes.normalize_dim(dim, len(src_shape)) + [index]), src_shape)
            return
        if axes.is_method(node, "expand", "expand_as") and len(shape) == len(src_shape):
            return  # broadcasts size-1 axes (the head axis over the query heads): roles stay
        if axes.is_method(node, "expand", "expand_as") and len(shape) > len(src_shape):
            extra = len(shape) - len(src_shape)
            for piece in self.pieces:
                piece.dims = [_Axis(None) for _ in range(extra)] + piece.dims
            return
        if axes.is_method(node, "flatten") or axes.is_function(node, torch.flatten):
            start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
            end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
            start, end = axes.normalize_dim(start, len(src_shape)), axes.normalize_dim(end, len(src_shape))
            if end != start + 1:
                raise ReadRefused("a flatten of more than two axes of a cache read")
            self._merge(start)
            return
        if axes.is_method(node, "view", "reshape", "unflatten") or axes.is_function(node, torch.reshape):
            merged = axes.flatten_source(node)
            if merged is not None and merged[0] is src:
                self._merge(merged[1])
                return
            self._singleton_view(src_shape, shape)
            return
        moved = axes.axis_moving_step(node)
        if moved is None or moved[0] is not src:
            raise ReadRefused(f"`{_op_name(node)}` on a cache read")
        order = moved[1]
        for piece in self.pieces:
            piece.dims = [_Axis(None) if o is None else piece.dims[o] for o in order]

    def _getitem(self, index: Any, src_shape: tuple) -> None:
        entries = _index_entries(index, len(src_shape))
        for piece in self.pieces:
            if len(piece.dims) != len(src_shape):
                raise ReadRefused("pieces of a cache read disagree in rank")
        new_dims: list[list[_Axis]] = [[] for _ in self.pieces]
        dim = 0
        feature_slice = None
        feature = _feature_dim(self.pieces[0])  # where the pieces' feature axis is now
        for entry in entries:
            if entry is None:
                for out in new_dims:
                    out.append(_Axis(None))
                continue
            if isinstance(entry, fx.Node) or isinstance(entry, torch.Tensor):
                raise ReadRefused("a cache read indexed by a tensor")
            if isinstance(entry, int) and not isinstance(entry, bool):
                if not axes.known_equal(src_shape[dim], 1) or entry not in (0, -1):
                    raise ReadRefused("an integer index into a cache read")
                dim += 1
                continue
            if not isinstance(entry, slice):
                raise ReadRefused(f"index {entry!r} into a cache read")
            if dim == feature and not (entry.start in (None, 0) and entry.stop is None):
                feature_slice = entry
            else:
                for piece in self.pieces:
                    _apply_slice(piece, dim, entry)
            for piece, out in zip(self.pieces, new_dims):
                out.append(piece.dims[dim])
            dim += 1
        for piece, out in zip(self.pieces, new_dims):
            piece.dims = out
        if feature_slice is not None:
            self.pieces = _slice_feature(self.pieces, feature_slice, src_shape[feature])

    def _merge(self, dim: int) -> None:
        """Axes `dim` and `dim + 1` become one: only where the layout says what that is
        (a paged pool's pages and in-page slots make its positions)."""
        for piece in self.pieces:
            a, b = piece.dims[dim].source, piece.dims[dim + 1].source
            merged = piece.merges.get((a, b))
            if merged is None:
                raise ReadRefused("a view that merges two axes of a cache read")
            piece.dims[dim : dim + 2] = [_Axis(merged)]

    def _singleton_view(self, src_shape: tuple, shape: tuple) -> None:
        """A view that only adds or drops axes of size 1 (`view(b, 1, t, d)` of `[b, t, d]`)."""
        kept = [i for i, s in enumerate(src_shape) if not axes.known_equal(s, 1)]
        new = [i for i, s in enumerate(shape) if not axes.known_equal(s, 1)]
        if len(kept) != len(new) or not all(axes.known_equal(src_shape[a], shape[b]) for a, b in zip(kept, new)):
            raise ReadRefused("a view that merges or splits axes of a cache read")
        # Between two axes of size > 1 (the anchors), the size-1 axes of the source that
        # carry a cache role (a batch of one, say) map in order onto the size-1 axes of
        # the view; the other size-1 axes of the view are new.
        bounds_src = [-1] + kept + [len(src_shape)]
        bounds_dst = [-1] + new + [len(shape)]
        for piece in self.pieces:
            dims: list[_Axis] = [_Axis(None) for _ in shape]
            for a, b in zip(kept, new):
                dims[b] = piece.dims[a]
            for seg in range(len(bounds_src) - 1):
                src_ones = [
                    i for i in range(bounds_src[seg] + 1, bounds_src[seg + 1]) if piece.dims[i].source is not None
                ]
                dst_ones = list(range(bounds_dst[seg] + 1, bounds_dst[seg + 1]))
                for i, j in zip(src_ones, dst_ones):
                    dims[j] = piece.dims[i]
            piece.dims = dims


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


_CHAIN_METHODS = {
    "permute",
    "transpose",
    "swapaxes",
    "unsqueeze",
    "expand",
    "expand_as",
    "view",
    "reshape",
    "squeeze",
    "select",
    "narrow",
    "mT",
    "t",
    "unflatten",
    "flatten",
} | axes.DTYPE_CASTS
_CHAIN_FUNCTIONS = {
    operator.getitem,
    torch.permute,
    torch.transpose,
    torch.swapaxes,
    torch.unsqueeze,
    torch.squeeze,
    torch.select,
    torch.narrow,
    torch.reshape,
    torch.flatten,
}


def _is_chain_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _CHAIN_METHODS) or (
        node.op == "call_function" and node.target in _CHAIN_FUNCTIONS
    )


def _cat_inputs(node: fx.Node) -> Optional[tuple[list, int]]:
    if node.op == "call_function" and node.target in (torch.cat, torch.concat, torch.concatenate):
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if isinstance(tensors, (list, tuple)) and isinstance(dim, int):
            return list(tensors), dim
    return None


def _trace_pieces(node: fx.Node, depth: int = 0) -> list[_Piece]:
    """The pieces `node` is made of (replayed up to `node`); raises ReadRefused."""
    chain: list[fx.Node] = []
    current = node
    pieces = None
    while not is_cache_tensor(current):
        if len(chain) > MAX_CHAIN:
            raise ReadRefused("too many views between the cache tensor and the attention")
        if not isinstance(current, fx.Node):
            raise ReadRefused("a constant where a cache read was expected")
        based = next(
            (
                (kind, p)
                for kind, p in ((k, k.read_base(current)) for k in cache_kinds() if k.read_base)
                if p is not None
            ),
            None,
        )
        if based is not None:
            kind, piece = based
            piece.kind = kind
            pieces = [piece]
            break
        cat = _cat_inputs(current)
        if cat is not None:
            tensors, dim = cat
            pieces = _cat_pieces(current, tensors, dim, depth)
            break
        if not _is_chain_op(current) or not current.args or not isinstance(current.args[0], fx.Node):
            raise ReadRefused(
                "not a view of a cache tensor"
                if not chain
                else f"`{_op_name(current)}` between a cache tensor and the attention"
            )
        chain.append(current)
        current = current.args[0]
    else:
        rank = len(axes.shape_of(current))
        pieces = [_Piece(current, [_Axis(i) for i in range(rank)], {}, None)]
    replay = _Replay(pieces)
    for view in reversed(chain):
        replay.step(view, view.args[0])
        if not replay.pieces:
            raise ReadRefused("a feature slice that keeps no column of the cache")
    return replay.pieces


# A cache that is a graph input concatenated with new rows along its token axis has no fixed
# size: its stripes would differ in length across ranks and calls. What the user can do about
# it depends on where the concatenation is, so each place has its own reason.
_STATIC_INSTEAD = 'pass cache_implementation="static" to generate(), or a StaticCache'
GROWING_CACHE = (
    "the cache grows by torch.cat along its token axis at every step (Hugging Face's DynamicCache, "
    f"generate()'s default): DCP stripes caches of a fixed size; {_STATIC_INSTEAD}"
)
GROWING_QUANTIZED_CACHE = (
    "Hugging Face's QuantizedCache rebuilds the keys and values at every step (it dequantizes all "
    "of its rows and appends its full-precision residual and the new rows by torch.cat, then "
    "quantizes them all again every residual_length steps): DCP stripes caches of a fixed size; "
    f"{_STATIC_INSTEAD}"
)
GROWING_WINDOW_CACHE = (
    "a sliding-window layer of Hugging Face's DynamicCache: it appends the new rows by torch.cat "
    "and keeps the last sliding_window - 1, a cache bounded by the window with nothing that grows "
    "with the context for DCP to stripe"
)
GROWING_MODEL_CACHE = (
    "the model's own code grows the cache its attention reads by torch.cat at every step: DCP "
    "stripes a cache held in a buffer of a fixed size that the model writes rows into, and this "
    "model's cache has none"
)

# ops between a stored cache tensor and the rows a growing cache concatenates: views, and the
# copies Hugging Face's caches make of what they store (moved back from the CPU by offloading,
# dequantized, reordered for beam search)
_STORED_ROWS_METHODS = {"to", "cuda", "contiguous", "clone", "dequantize", "index_select"}


def _copy_chain(node: Any, hops: int = 4) -> Iterator[fx.Node]:
    """`node` and what it copies, back through views and the copies a cache makes of its stored
    rows (`_STORED_ROWS_METHODS`), nearest first; the last is the first node that is not such a copy."""
    for _ in range(hops):
        node = fx_util.view_base(node)
        if not isinstance(node, fx.Node):
            return
        yield node
        if not (node.op == "call_method" and node.target in _STORED_ROWS_METHODS and node.args):
            return
        node = node.args[0]


def _stored_rows(node: Any, hops: int = 4) -> Optional[fx.Node]:
    """The graph input `node` is the stored rows of (through views and copies), or None."""
    return next((n for n in _copy_chain(node, hops) if n.op == "placeholder"), None)


def _inputs_back(node: fx.Node, hops: int) -> Iterator[fx.Node]:
    """The nodes `node` reads, up to `hops` ops back, nearest first, each once."""
    seen: set[fx.Node] = set()
    frontier = [node]
    for _ in range(hops):
        nxt: list[fx.Node] = []
        for n in frontier:
            for i in n.all_input_nodes:
                if i not in seen:
                    seen.add(i)
                    yield i
                    nxt.append(i)
        frontier = nxt


def growing_cache(node: fx.Node, hops: int = 16) -> Optional[fx.Node]:
    """The concatenation, among `node`'s inputs up to `hops` ops back, that appends rows to a
    graph input (or a copy of one) along its token axis (the axis before the features), or None."""
    for i in _inputs_back(node, hops):
        cat = _cat_inputs(i)
        shape = axes.shape_of(i)
        if cat is not None and shape is not None:
            tensors, dim = cat
            if axes.normalize_dim(dim, len(shape)) == len(shape) - 2 and any(
                _stored_rows(t) is not None for t in tensors
            ):
                return i
    return None


def growing_cache_reason(cat: fx.Node) -> str:
    """Why the growing cache that `cat` (found by `growing_cache`) extends cannot be striped, in
    the user's terms: by the cache class, or by the model when its own code grows the cache."""
    tensors, _ = _cat_inputs(cat) or ([], 0)
    if any(_dequantized(t) for t in tensors):
        return GROWING_QUANTIZED_CACHE
    if not _innermost_file(cat).endswith("cache_utils.py"):
        return GROWING_MODEL_CACHE
    if _keeps_last_rows(cat):
        return GROWING_WINDOW_CACHE
    return GROWING_CACHE


def _dequantized(node: Any, hops: int = 4) -> bool:
    """Whether `node` is a dequantized stored tensor (through views and copies)."""
    return any(n.op == "call_method" and n.target == "dequantize" and n.args for n in _copy_chain(node, hops))


def _keeps_last_rows(cat: fx.Node) -> bool:
    """Whether a use of `cat` keeps only its last rows along the token axis (`x[:, :, -k:]`, a
    sliding window's cache)."""
    rank = len(axes.shape_of(cat) or ())
    for user in cat.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], tuple):
            continue
        index = user.args[1]
        if len(index) == rank and isinstance(index[rank - 2], slice):
            start, stop = index[rank - 2].start, index[rank - 2].stop
            if isinstance(start, int) and start < 0 and stop is None:
                return True
    return False


def _innermost_file(node: fx.Node) -> str:
    """The file of the innermost frame of the user code that made `node` ("" if unknown)."""
    files = re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or "")
    return files[-1] if files else ""


# A cache tensor the graph copies to another device: Hugging Face's offloading moves each layer's
# cache to the CPU after its attention and back before its next one, and rebinds the layer's
# tensors to the copies, so what the attention reads is a new tensor at every step.
OFFLOADED_CACHE = (
    "the cache is offloaded: Hugging Face's offloading copies each layer's cache to the CPU after "
    'its attention and back to the GPU before its next one (cache_implementation="offloaded_static" '
    'or "offloaded"), so the attention reads a new copy at every step: DCP stripes a cache that '
    'stays on its rank\'s device; pass cache_implementation="static" (the stripes divide each '
    "rank's cache memory by dcp_size)"
)


def offloaded_cache(node: fx.Node, hops: int = 16) -> Optional[fx.Node]:
    """The copy onto another device of a cache tensor that `node` reads (among its inputs up to
    `hops` ops back): the copy it reads (a cache moved back from the CPU), or one the graph makes
    of a cache tensor it reads in place (moved to the CPU after the attention); None if neither."""
    for i in _inputs_back(node, hops):
        if is_cache_tensor(i):
            moved = next((u for u in _uses_through_views(i) if _device_copy(u)), None)
            if moved is not None:
                return moved
        elif _device_copy(i) and is_cache_tensor(fx_util.view_base(i.args[0])):
            return i
    return None


def _device_copy(node: fx.Node) -> bool:
    """Whether `node` copies a tensor onto another device (`.to(device)`, `.cpu()`, `.cuda()`)."""
    if node.op != "call_method" or node.target not in ("to", "cpu", "cuda") or not node.args:
        return False
    before, after = axes.example_value(node.args[0]), axes.example_value(node)
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.device != after.device


def _uses_through_views(node: fx.Node) -> list[fx.Node]:
    """The users of `node` and of its views."""
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        found.append(user)
        if fx_util.view_base(user) is node and user is not node:
            stack.extend(user.users)
    return found


def _cat_pieces(node: fx.Node, tensors: list, dim: int, depth: int) -> list[_Piece]:
    if depth > 4:
        raise ReadRefused("nested concatenations of cache reads")
    shape = axes.shape_of(node)
    if shape is None or axes.normalize_dim(dim, len(shape)) != len(shape) - 1:
        raise ReadRefused("cache reads concatenated along an axis other than the feature axis")
    pieces: list[_Piece] = []
    offset = 0
    for tensor in tensors:
        if not isinstance(tensor, fx.Node):
            raise ReadRefused("a constant concatenated to a cache read")
        width = axes.shape_of(tensor)[-1]
        for piece in _trace_pieces(tensor, depth + 1):
            c0, c1 = piece.cols or (0, width)
            piece.cols = (offset + c0, offset + c1)
            pieces.append(piece)
        offset += width
    return pieces


def _read_of(node: fx.Node, piece: _Piece) -> CacheRead:
    if piece.kind.local_read is None:  # e.g. a static cache, whose own attention forms read it whole
        raise ReadRefused(
            f"{buffer_name(piece.buffer)} is {piece.kind.words}, read whole by its own attention "
            f"forms, not through views"
        )
    layout, shape = piece.layout, piece.shape
    roles = [None if d.source is None else layout[d.source] for d in piece.dims]
    seen = {d.source for d in piece.dims if d.source is not None}
    for axis, role in enumerate(layout):
        if role in (B, T, F) and axis not in seen:
            raise ReadRefused(f"the cache read drops its {_ROLE_WORDS[role]} axis")
    if any(r not in (B, T, F, None) for r in roles):
        raise ReadRefused("a paged read whose pages are not merged into positions")
    for axis, (lo, hi) in piece.bounds.items():
        # a paged read's pages and in-page slots become positions only whole: the striped read
        # gathers every page of the table and every slot of a page
        if layout[axis] not in (B, T, F) and not (lo == 0 and hi in (None, shape[axis])):
            raise ReadRefused(f"a paged read of part of its {layout[axis]} ({lo}:{hi} of {shape[axis]})")
    b_axis, t_axis, f_axis = layout.index(B), layout.index(T), layout.index(F)
    b0, b1 = piece.bounds.get(b_axis, (0, None))
    if piece.pages is not None and not (isinstance(b0, int) and b0 == 0):
        raise ReadRefused("a paged read that skips leading rows of its block table")
    t0, t1 = piece.bounds.get(t_axis, (0, None))
    f0, f1 = piece.bounds.get(f_axis, (0, None))
    width = shape[f_axis]
    f1 = width if f1 is None else f1
    if not (isinstance(f0, int) and isinstance(f1, int)):
        raise ReadRefused("symbolic feature columns of a cache read")
    feat = None if (f0, f1) == (0, width) else (f0, f1)
    bsz = shape[b_axis] if b1 is None else b1
    end = shape[t_axis] if t1 is None else t1
    return CacheRead(
        node, piece.buffer, bsz, t0, end, feat, roles, piece.cols, piece.pages, piece.page_size, b0, piece.kind
    )


_ROLE_WORDS = {B: "batch", T: "position", F: "feature"}


def trace_cache_read(node: Any) -> list[CacheRead]:
    """The cache reads an attention operand is made of (one, or several concatenated along
    features); raises ReadRefused with the reason. Every piece covers the same rows."""
    if not isinstance(node, fx.Node):
        raise ReadRefused("a constant where a cache read was expected")
    pieces = _trace_pieces(node)
    reads = [_read_of(node, p) for p in pieces]
    first = reads[0]
    for other in reads[1:]:
        if other.roles != first.roles:
            raise ReadRefused("concatenated cache reads have different layouts")
        if not (
            _same(other.bsz, first.bsz)
            and _same(other.row0, first.row0)
            and _same(other.start, first.start)
            and _same(other.end, first.end)
        ):
            raise ReadRefused("concatenated cache reads cover different rows or positions")
    return reads


def _same(a: SizeArg, b: SizeArg) -> bool:
    return a is b or axes.known_equal(a, b)


def reaches_cache(node: Any) -> bool:
    """Whether `node` is (a view of) a cache tensor."""
    try:
        trace_cache_read(node)
    except ReadRefused:
        return False
    return True


def single_read(node: Any) -> Optional[CacheRead]:
    """The read when `node` is one view chain of one cache tensor, else None."""
    try:
        reads = trace_cache_read(node)
    except ReadRefused:
        return None
    return replace(reads[0], cols=None) if len(reads) == 1 else None


# ----------------------------------------------------------------------------- writes


@dataclass
class CacheAccess:
    """A write `buffer[row0:bsz, start:end(, f0:f1)] = value`, at a tensor of positions
    (`buffer[:bsz, positions] = value`), or at one position per request
    (`buffer[rows, positions] = value`, `rows` and `positions` both [N])."""

    node: fx.Node
    buffer: fx.Node
    bsz: SizeArg
    start: SizeArg
    end: SizeArg
    feat: Optional[tuple[int, int]]  # absolute feature columns, None = all
    value: Optional[fx.Node] = None  # the written tensor
    positions: Optional[fx.Node] = None  # a LongTensor of positions, for `buffer[:b, pos] = v`
    rows: Optional[fx.Node] = None  # a LongTensor of batch rows, one per position
    row0: SizeArg = 0  # the first batch row written (a slice `buffer[row0:bsz]`)
    # the kind whose write form matched it (set by `cache_writes`), or that it was converted to
    kind: Optional[CacheKind] = None

    def rewrite_write(self, graph: fx.Graph, local: fx.Node, entry) -> fx.Node:
        """Replace this write by a striped write into the shard `local` (:func:`rewrite_write`)."""
        return rewrite_write(graph, self, local, entry)

    def as_kind(self, kind: CacheKind) -> Optional["CacheAccess"]:
        """This write read as a write into a cache of kind `kind` (how the attention reads it),
        or None when it means something else there."""
        if kind is self.kind:
            return self
        convert = next((to for source, to in kind.write_conversions if source is self.kind), None)
        converted = convert(self) if convert is not None else None
        if converted is not None:
            converted.kind = kind
        return converted

    def describe(self) -> str:
        """The write's form, in the user's terms."""
        if self.rows is not None:
            return "one position per request (`cache[rows, positions] = v`)"
        if self.positions is not None:
            return "a tensor of positions (`cache[:b, positions] = v`)"
        return "a slice of positions (`cache[:b, start:end] = v`)"


def slice_bounds(index: Any) -> Optional[tuple[SizeArg, SizeArg]]:
    """(start, stop) of a step-1 slice (start 0 for None), else None."""
    if not isinstance(index, slice) or index.step not in (None, 1):
        return None
    start = 0 if index.start is None else index.start
    return start, index.stop


def batch_rows(index: Any) -> Optional[SizeArg]:
    """`bsz` for a `:bsz` batch slice, else None."""
    bounds = slice_bounds(index)
    return bounds[1] if bounds is not None and bounds[0] == 0 else None


def parse_cache_index(
    buffer: fx.Node, index: Any
) -> Optional[tuple[SizeArg, SizeArg, SizeArg, Optional[tuple[int, int]], SizeArg]]:
    """(bsz, start, end, feat, row0) for `buffer[row0:bsz, start:end(, f0:f1)]`, else None.

    One index entry per cache axis in the cache's layout (missing trailing entries are
    whole axes); a singleton head axis must be taken whole. `buffer[:bsz]` covers every
    position (static-shape models that mask the unwritten ones).
    """
    layout = cache_layout(buffer)
    if layout is None:
        return None
    shape = axes.shape_of(buffer)
    entries = list(index) if isinstance(index, tuple) else [index]
    if len(entries) > len(layout) or not all(isinstance(e, slice) for e in entries):
        return None
    entries += [slice(None)] * (len(layout) - len(entries))
    bsz = start = end = None
    feat = None
    row0: SizeArg = 0
    for role, entry, size in zip(layout, entries, shape):
        bounds = slice_bounds(entry)
        if bounds is None:
            return None
        lo, hi = bounds
        if role == B:
            if isinstance(lo, int) and lo < 0 or isinstance(hi, int) and hi < 0:
                return None
            row0, bsz = lo, (size if hi is None else hi)
        elif role == T:
            start, end = lo, (size if hi is None else hi)
        elif role == F:
            if not isinstance(lo, int) or not isinstance(hi if hi is not None else 0, int):
                return None
            f0, f1 = lo, size if hi is None else hi
            f0, f1 = (f0 + size if f0 < 0 else f0), (f1 + size if f1 < 0 else min(f1, size))
            feat = None if (f0, f1) == (0, size) else (f0, f1)
        elif entry != slice(None):
            return None
    return bsz, start, end, feat, row0


def as_cache_write(node: fx.Node) -> Optional[CacheAccess]:
    if node.op == "call_function" and node.target is operator.setitem and is_cache_tensor(node.args[0]):
        buffer, index, value = node.args
        if not isinstance(value, fx.Node):
            return None
        parsed = parse_cache_index(buffer, index)
        if parsed is not None:
            bsz, start, end, feat, row0 = parsed
            return CacheAccess(node, buffer, bsz, start, end, feat, value=value, row0=row0)
        if (
            cache_layout(buffer) == (B, T, F)
            and isinstance(index, tuple)
            and len(index) == 2
            and all(_index_vector(i) for i in index)
        ):
            # `buffer[rows, positions] = v`: request rows[i] at position positions[i] (per-request decode)
            return CacheAccess(node, buffer, None, None, None, None, value=value, positions=index[1], rows=index[0])
        # `buffer[:b, positions] = v` with a position tensor (static-shape decode)
        if (
            cache_layout(buffer) == (B, T, F)
            and isinstance(index, tuple)
            and len(index) == 2
            and isinstance(index[1], fx.Node)
        ):
            bsz = batch_rows(index[0])
            positions = axes.example_value(index[1])
            if (
                bsz is not None
                and isinstance(positions, torch.Tensor)
                and positions.dim() == 1
                and not positions.is_floating_point()
            ):
                return CacheAccess(node, buffer, bsz, None, None, None, value=value, positions=index[1])
    return None


def _index_vector(index: Any) -> bool:
    """Whether `index` is a 1-D integer tensor."""
    value = axes.example_value(index) if isinstance(index, fx.Node) else None
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and not value.is_floating_point()
        and value.dtype != torch.bool
    )


def cache_writes(graph: fx.Graph) -> dict[fx.Node, list[CacheAccess]]:
    """Every write of a cache tensor in `graph`, by cache tensor (the first kind whose form matches)."""
    kinds = [kind for kind in cache_kinds() if kind.write_form]
    writes: dict[fx.Node, list[CacheAccess]] = {}
    for node in graph.nodes:
        found = next(((k, a) for k, a in ((k, k.write_form(node)) for k in kinds) if a is not None), None)
        if found is not None:
            kind, access = found
            access.kind = kind
            writes.setdefault(access.buffer, []).append(access)
    return writes


def rewrite_write(graph: fx.Graph, write: CacheAccess, local: fx.Node, entry) -> fx.Node:
    """`buffer[:b, s:e(, f0:f1)] = v` -> `write_owned_tokens_(shard, v, s, c, rank, capacity, f0)`,
    `buffer[:b, positions(, f0:f1)] = v` -> `write_tokens_at_(shard, v, positions, ...)`,
    `buffer[rows, positions] = v` -> `write_request_tokens_at_(shard, v, rows, positions, ...)`;
    `buffer[row0:b, ...]` writes into `shard[row0:b]`.

    Traceable runtime functions, not custom ops: the inner compiler sees (and fuses) the
    plain tensor ops inside, with no opaque call on the decode path. Both check the
    capacity themselves (a constant start fails while the graph is traced). `entry`: the
    shard's state.store.LocalCache (its c, rank and virtual capacity).
    """
    if write.rows is not None:
        args = (
            local,
            write.value,
            write.rows,
            write.positions,
            entry.c,
            entry.rank,
            entry.virtual_capacity,
            write.feat[0] if write.feat else 0,
        )
        return fx_util.replace_node(graph, write.node, layout.write_request_tokens_at_, args, name="striped_write")
    if write.positions is not None:
        fn, where = layout.write_tokens_at_, write.positions
    else:
        fn, where = layout.write_owned_tokens_, write.start
    shard, value = local, write.value
    if not (isinstance(write.row0, int) and write.row0 == 0):  # rows further down the batch (a request's prefill)
        with graph.inserting_before(write.node):
            shard = fx_util.call(graph, operator.getitem, local, slice(write.row0, write.bsz), name="shard_batch_rows")
            fx_util.set_example_value(shard)
    head = _singleton_head_axis(write.buffer)
    if head is not None:  # [B, T, 1, F] / [B, 1, T, F]: the write is on the [B, T, F] view
        with graph.inserting_before(write.node):
            index = (slice(None),) * head + (0,)
            shard = fx_util.call(graph, operator.getitem, shard, index, name="shard_rows")
            value = fx_util.call(graph, operator.getitem, write.value, index, name="written_rows")
            for node in (shard, value):  # later passes (device positions) read their shapes
                fx_util.set_example_value(node)
    args = (shard, value, where, entry.c, entry.rank, entry.virtual_capacity, write.feat[0] if write.feat else 0)
    return fx_util.replace_node(graph, write.node, fn, args, name="striped_write")


def _singleton_head_axis(buffer: fx.Node) -> Optional[int]:
    roles = cache_layout(buffer)
    return roles.index(None) if roles is not None and None in roles else None
