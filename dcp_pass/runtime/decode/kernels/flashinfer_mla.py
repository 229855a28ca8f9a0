"""Shard-local MLA attention through FlashInfer's ``BatchMLAPagedAttentionWrapper``.

The registry's "flashinfer" kernel: :func:`run` takes an
:class:`~dcp_pass.runtime.decode.call.AttentionCall` (dense shards or page pools) with the
torch reference's contract (``kernels/reference.py``): ``(out [B,S,H,v_dim] in q dtype,
lse fp32 [B,S,H])`` in the call's LSE base, output 0 and LSE -inf for a row that sees no
key. Written against flashinfer-python 0.2.x (checked: 0.2.14.post1, whose MLA
kernels are built by nvcc on first use).

How our operands map onto FlashInfer's:

* every (row b, query token s) becomes one FlashInfer request of one query token
  (``qo_indptr = arange(N + 1)``, N = B * S). Its key count is what that token may see:
  ``kv_lens[b]``, and with ``causal=(q_pos, c, r)`` only local keys k with global position
  ``k * c + r <= q_pos[b, s]``, i.e. ``min(kv_lens[b], floor((q_pos - r) / c) + 1)``: a
  prefix of the shard, so FlashInfer's non-causal kernel over that prefix is exact. (Its own
  causal mode aligns queries to the end of an unstriped sequence: wrong for c > 1.)
* dense shards ``kv [B, T, Dk]`` are passed without a copy as a paged cache whose page is
  one whole row: ``page_size = T``, page stride ``kv.stride(0)``, ``kv_indices[n] = b``.
* paged pools ``[num_pages, P, Dk]`` are passed as they are; request n lists the first
  ``ceil(count / P)`` pages of its row of ``page_table``.
* the latent part (512 columns) is both keys and values, the rope part (64) keys only;
  ``v_dim < 512`` (split cache) slices the output.

Host plans and CUDA graphs. ``plan()`` schedules the work on the host from the key counts,
so device-side ``kv_lens`` / ``q_pos`` cost a device-to-host sync per call, unless the call
knows its count on the host (``AttentionCall.host_lens``): an int-position decode graph's
step count, which the backend holds and hands to the ops (runtime/decode/step_count.py).
Such a dense call without a causal cap runs on a wrapper of its own plan shape whose plan
lives in fixed device buffers (FlashInfer's ``use_cuda_graph`` mode: the launches' grid and
workspace offsets depend on the batch, heads and query length only). On a call that is not
captured it registers a planner with the graph being run, and the backend re-plans into
those buffers before every later call; the launches can then be captured, and a replay
reads the plan of its own step. Rows with no key are then found on the device (a replay
cannot branch on host counts). Any other call inside capture is refused with an error.

Limits (each refused with an error that says so, never a wrong answer):
* no additive ``mask`` (FlashInfer's MLA kernel has causal and non-causal only); the pass
  runs a masked layer on "auto"'s kernels instead (rewrites/attention.py, layer_backend).
* fp16 / bf16 only, query and cache of one dtype; latent 512 and rope 64 columns (the MLA
  kernels are written for DeepSeek's dims); CUDA, compute capability 8.0+ (fa2), the
  Hopper path (fa3) on 9.x.
* the kernel forms element offsets in 32 bits: a pool must span < 2**32 elements; dense
  shards larger than that are split into row chunks.

The LSE FlashInfer returns is base 2 (``log2(sum) + max`` of the base-2-scaled scores);
the requested base is applied here, so the backend table's ``lse_base = "2"`` is native.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# .common imports Triton: import it where used, so the availability check (options
# validation, the backend table) stays free of kernel imports
LN2 = 0.6931471805599453

__all__ = [
    "supports",
    "run",
    "CKV_DIM",
    "KPE_DIM",
    "unavailable",
    "visible_counts",
    "row_chunks",
    "paged_request_pages",
    "warmup",
    "offered",
    "unmeasured",
]

CKV_DIM = 512  # latent columns the MLA kernels are written for
KPE_DIM = 64  # rope columns
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# FlashInfer 0.2.x's MLA scheduler has 16384 work slots and does not check for overflow;
# one request of one query token is one or two work items per 64-128 heads, plus one
# split per cluster. Keep each plan well inside.
WORK_CAP = 8192
# the kernel's packed key positions (page index * page size + offset) are uint32; keep signed range
POS_CAP = 2**31 - 1
# element offsets (page index * page stride + row * row stride + column) are uint32
SPAN_CAP = 2**32 - 1
_ROWS_PER_TILE = 64  # smallest query tile of the MLA kernels (packed query x head rows)


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _installed() -> bool:
    """Whether flashinfer can be imported (looked up once: the chooser asks at every call)."""
    return importlib.util.find_spec("flashinfer") is not None


def unavailable(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when FlashInfer's MLA path can run on `device` with cache dtype `dtype`, else why not.

    Cheap: it does not import flashinfer (options validation calls it).
    """
    device = torch.device(device)
    if importlib.util.find_spec("flashinfer") is None:
        return "cannot run: flashinfer is not installed"
    if device.type != "cuda":
        return f"cannot run: it needs CUDA tensors, the model is on {device.type}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"cannot run: FlashInfer's MLA kernels take float16/bfloat16 caches, not {dtype}"
    if not torch.cuda.is_available():
        return "cannot run: no CUDA device is available"
    major, minor = torch.cuda.get_device_capability(device.index if device.index is not None else None)
    if major < 8:
        return f"cannot run: FlashInfer's MLA kernels need compute capability 8.0+, this GPU is {major}.{minor}"
    return None


def supports(shape) -> Optional[str]:
    """The registry's check: where FlashInfer can run (:func:`unavailable`, from the
    call's shape). A mask is refused by the run itself, with its own message (the pass refuses
    masked layers at compile time, backend table ``takes_mask``)."""
    if shape.per_head or shape.offset_lens:
        from .common import mla_refusal

        return mla_refusal(shape)
    if not _installed():
        return "cannot run: flashinfer is not installed"
    if shape.device != "cuda":
        return f"cannot run: it needs CUDA tensors, the model is on {shape.device}"
    if shape.kv_quant:
        from .common import fp8_reason

        return f"cannot run: {fp8_reason(shape)}"
    if shape.dtype not in SUPPORTED_DTYPES:
        return f"cannot run: FlashInfer's MLA kernels take float16/bfloat16 caches, not {shape.dtype}"
    if shape.capability is not None and shape.capability < 8:
        return f"cannot run: FlashInfer's MLA kernels need compute capability 8.0+, this GPU is {shape.capability}.x"
    return None


def offered(shape) -> Optional[str]:
    """The chooser considers FlashInfer (under "auto") only where its plan costs no sync: key
    counts known on the host, no mask, no causal cap (a cap's query positions are device data
    in a decode graph)."""
    if not shape.host_lens:
        return "its host-side plan would read the device key counts (a sync per call)"
    if shape.mask != "none" or shape.causal:
        return "a masked or causal call"
    return None


def unmeasured(shape) -> bool:
    """Chosen only where measured faster (kernels/path_table.py)."""
    return False


def run(call, out=None, lse_out=None):
    """The registry's entry: FlashInfer MLA over the call's rank view, its dense shards or
    page pools (see the module doc)."""
    view = call.shard()
    return _run_paged(view, out, lse_out) if view.paged else _run_dense(view, out, lse_out)


# --------------------------------------------------------------------------------------
# host-side planning (pure functions of host tensors; tested on CPU)
# --------------------------------------------------------------------------------------
def visible_counts(
    lens: torch.Tensor,
    S: int,
    T: Optional[int] = None,
    q_pos: Optional[torch.Tensor] = None,
    cp_world: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Keys each query token sees, as a host int64 ``[B, S]``.

    ``lens [B]``: local key counts (clipped to ``[0, T]`` when ``T`` is given). With
    ``q_pos [B, S]`` (global query positions), local key k (global position
    ``k * cp_world + cp_rank``) is visible when that position is ``<= q_pos``: the first
    ``floor((q_pos - cp_rank) / cp_world) + 1`` keys (none when negative).
    """
    lens = lens.to("cpu", torch.int64).reshape(-1).clamp(min=0)
    if T is not None:
        lens = lens.clamp(max=int(T))
    counts = lens.view(-1, 1).expand(lens.numel(), int(S))
    if q_pos is not None:
        q = torch.broadcast_to(q_pos.to("cpu", torch.int64), counts.shape)
        causal = torch.div(q - int(cp_rank), int(cp_world), rounding_mode="floor") + 1
        counts = torch.minimum(counts, causal.clamp(min=0))
    return counts.contiguous()


def row_chunks(
    requests_per_row: Sequence[int],
    positions_per_row: Sequence[int],
    work_per_request: int,
    max_rows: Optional[int] = None,
    work_cap: Optional[int] = None,
    pos_cap: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """Split rows ``[0, B)`` into consecutive chunks ``(b0, b1)`` that each fit one plan.

    A chunk's work items (requests x ``work_per_request``) stay within ``work_cap``, its
    packed key positions (the sum of ``positions_per_row``) within ``pos_cap`` and its
    row count within ``max_rows`` (caps default to ``WORK_CAP`` / ``POS_CAP``). A row that
    alone exceeds a cap raises ``ValueError``.
    """
    work_cap = WORK_CAP if work_cap is None else work_cap
    pos_cap = POS_CAP if pos_cap is None else pos_cap
    B = len(requests_per_row)
    if len(positions_per_row) != B:
        raise ValueError("requests_per_row and positions_per_row differ in length")
    if max_rows is not None and max_rows < 1:
        raise ValueError("a single row spans more than 2**32 elements: the kernel's 32-bit offsets would wrap")
    chunks: List[Tuple[int, int]] = []
    b0, work, pos = 0, 0, 0
    for b in range(B):
        w, p = int(requests_per_row[b]) * int(work_per_request), int(positions_per_row[b])
        if w > work_cap:
            raise ValueError(f"row {b} alone needs {w} work items, over FlashInfer's plan capacity ({work_cap})")
        if p > pos_cap:
            raise ValueError(f"row {b} alone spans {p} packed key positions, over the kernel's 32-bit range")
        full = b > b0 and (work + w > work_cap or pos + p > pos_cap or (max_rows is not None and b - b0 >= max_rows))
        if full:
            chunks.append((b0, b))
            b0, work, pos = b, 0, 0
        work += w
        pos += p
    if B > b0:
        chunks.append((b0, B))
    return chunks


def paged_request_pages(
    counts: torch.Tensor, rows: torch.Tensor, page_size: int, max_pages: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per request n (of row ``rows[n]`` seeing ``counts[n]`` keys): FlashInfer's
    ``kv_indptr`` (int32 ``[N + 1]``, pages per request, cumulated) and the flat positions
    ``rows[n] * max_pages + j`` (int64) of its pages ``j < ceil(counts[n] / page_size)`` in
    a ``[B, max_pages]`` page table. Host tensors."""
    counts = counts.to("cpu", torch.int64).reshape(-1)
    rows = rows.to("cpu", torch.int64).reshape(-1)
    if counts.numel() != rows.numel():
        raise ValueError("counts and rows differ in length")
    npages = torch.div(counts + page_size - 1, page_size, rounding_mode="floor")
    if npages.numel() and int(npages.max()) > max_pages:
        raise ValueError(f"a request needs {int(npages.max())} pages, the page table has {max_pages} per row")
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(npages, 0, out=indptr[1:])
    total = int(indptr[-1])
    starts = torch.repeat_interleave(indptr[:-1], npages)
    within = torch.arange(total, dtype=torch.int64) - starts
    flat = torch.repeat_interleave(rows, npages) * max_pages + within
    return indptr.to(torch.int32), flat


def _span(t: torch.Tensor, dims: Sequence[int]) -> int:
    """Largest element offset (plus one) the kernel forms inside `t` over `dims` and the last dim."""
    last = (t.shape[-1] - 1) * t.stride(-1) + 1
    return last + sum((t.shape[d] - 1) * t.stride(d) for d in dims if t.shape[d] > 0)


def _rows_within_span(tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """How many rows of the dense [B, T, D] views fit in one chunk's 32-bit offsets."""
    best = None
    for t in tensors:
        tail = _span(t, (1,))
        if tail > SPAN_CAP:
            return 0
        rows = 1 + (SPAN_CAP - tail) // t.stride(0) if t.stride(0) > 0 else t.shape[0]
        best = rows if best is None else min(best, rows)
    return best


# --------------------------------------------------------------------------------------
# the wrapper, one per device
# --------------------------------------------------------------------------------------
@dataclass
class _Runner:
    wrapper: Any  # FlashInfer's wrapper (an optional, untyped dependency)
    key: Optional[tuple] = None
    event: Optional[torch.cuda.Event] = None
    step_plan: Optional[Callable[[int], None]] = None  # a fixed-buffer wrapper's planner (_dense_planner)


_RUNNERS: Dict[Tuple[int, str], _Runner] = {}
_GRAPH_RUNNERS: Dict[tuple, _Runner] = {}  # (device, backend, plan shape) -> its fixed-buffer wrapper
_WORKSPACES: Dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()


def _kept(index: int, make):
    """``make()``, whose allocations outlive the call (wrappers, workspaces, fixed plan
    buffers), run on a thread and stream of its own: CUDA-graph trees warm a graph up with
    the calling thread allocating into the graph's private pool, which must hold nothing but
    the graph's outputs afterwards. Done (its stream synchronised) before it returns."""
    result = {}

    def work():
        try:
            torch.cuda.set_device(index)
            stream = torch.cuda.Stream(device=index)
            with torch.cuda.stream(stream):
                result["value"] = make()
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            result["error"] = e

    worker = threading.Thread(target=work, name="dcp-flashinfer-alloc")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _workspace(index: int) -> torch.Tensor:
    """The float workspace of a device (split-KV partial results), shared by its wrappers:
    their calls run in stream order and each consumes its partials before the next starts.
    Called inside :func:`_kept`."""
    ws = _WORKSPACES.get(index)
    if ws is None:
        from dcp_pass import env

        mb = env.flashinfer_workspace_mb()
        ws = _WORKSPACES[index] = torch.empty(mb << 20, dtype=torch.uint8, device=torch.device("cuda", index))
    return ws


def _backend_choice() -> str:
    """DCP_FLASHINFER_MLA_BACKEND: "auto" (default), "fa2" or "fa3" (dcp_pass/env.py)."""
    from dcp_pass import env

    return env.flashinfer_mla_backend()


def _runner(device: torch.device) -> _Runner:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _backend_choice())
    with _LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            runner = _Runner(_kept(index, lambda: BatchMLAPagedAttentionWrapper(_workspace(index), backend=key[1])))
            _RUNNERS[key] = runner
    return runner


def _graph_runner(device: torch.device, shape: tuple, requests: int) -> _Runner:
    """The wrapper of one plan `shape` whose plan lives in fixed device buffers (FlashInfer's
    use_cuda_graph mode): captured launches read them, every later plan rewrites them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _backend_choice(), shape)
    with _LOCK:
        runner = _GRAPH_RUNNERS.get(key)
        if runner is None:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            dev = torch.device("cuda", index)
            fixed = lambda n: torch.zeros(n, dtype=torch.int32, device=dev)  # noqa: E731
            runner = _Runner(
                _kept(
                    index,
                    lambda: BatchMLAPagedAttentionWrapper(
                        _workspace(index),
                        use_cuda_graph=True,
                        qo_indptr=fixed(requests + 1),
                        kv_indptr=fixed(requests + 1),
                        kv_indices=fixed(requests),
                        kv_len_arr=fixed(requests),
                        backend=key[1],
                    ),
                )
            )
            _GRAPH_RUNNERS[key] = runner
    return runner


def _plan(
    runner: _Runner,
    key: Optional[tuple],
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_len,
    heads,
    page_size,
    scale,
    q_dtype,
    kv_dtype,
) -> None:
    """plan() unless the last plan of this wrapper had the same `key` (None: always plan).
    ``kv_indices`` may be a callable that builds them (called only when planning).

    plan() fills a pinned host buffer and queues its copy to the device without waiting:
    before refilling it, wait until the previous plan's copy has run.
    """
    if key is not None and runner.key == key:
        return
    if runner.event is not None:
        runner.event.synchronize()
    runner.key = None
    if callable(kv_indices):
        kv_indices = kv_indices()
    runner.wrapper.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len,
        heads,
        CKV_DIM,
        KPE_DIM,
        page_size,
        False,
        float(scale),
        q_dtype,
        kv_dtype,
    )
    device = getattr(runner.wrapper, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        # on the stream plan() queued its copy on: the device's current one
        runner.event = torch.cuda.Event()
        runner.event.record(torch.cuda.current_stream(device))
    runner.key = key


def warmup(device="cuda", dtype: torch.dtype = torch.bfloat16, heads: int = 16) -> None:
    """Build (nvcc, first use: about a minute or more) and load the MLA kernels for `dtype`
    by running one tiny call, so that the first real call does not pay for it."""
    device = torch.device(device)
    q = torch.zeros(1, 1, heads, CKV_DIM, dtype=dtype, device=device)
    qr = torch.zeros(1, 1, heads, KPE_DIM, dtype=dtype, device=device)
    kv = torch.zeros(1, 1, CKV_DIM, dtype=dtype, device=device)
    pe = torch.zeros(1, 1, KPE_DIM, dtype=dtype, device=device)
    from dcp_pass.runtime.decode.call import AttentionCall

    run(AttentionCall(q, qr, kv, pe, CKV_DIM, 1.0))
    torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------
# operand checks
# --------------------------------------------------------------------------------------
def _refuse(mask) -> None:
    if mask is not None:
        raise NotImplementedError(
            "attention backend 'flashinfer' takes no additive mask (FlashInfer's MLA kernel is "
            f"causal or unmasked only); this call passes one of shape {tuple(mask.shape)}. "
            "Use attn_backend='triton' or 'auto' for masked attention."
        )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_capture(why: str) -> None:
    raise RuntimeError(
        f"attention backend 'flashinfer' plans on the host and runs inside CUDA-graph capture only for "
        f"a decode graph whose key count the backend holds (an int step position), planned before the "
        f"capture; this call {why}. Compile with options={{'cudagraphs': False}} or use attn_backend='triton'."
    )


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the kernel's 128-bit loads suit it (unit last stride, 16-byte aligned
    base and strides), else a contiguous copy."""
    align = 16 // t.element_size()
    ok = (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s % align == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    )
    return t if ok else t.contiguous()


def _prepare(q_lat, q_rope, kv, pe, v_dim, mask, lse_base, page_table=None):
    """The entry points' checks, in this order: the LSE base, no mask (nor CUDA-graph
    capture), with a ``page_table`` the pool's and the table's shapes, then the operands
    (:func:`_operands`). Returns ``(base, parts)``."""
    from .common import check_base

    base = check_base(lse_base)
    _refuse(mask)
    if page_table is not None and _capturing():
        _refuse_capture("reads a page pool")
    if page_table is not None:
        if kv.dim() != 3:
            raise ValueError(f"kv_pool must be [num_pages, P, Dk], got {tuple(kv.shape)}")
        if page_table.dim() != 2 or page_table.shape[0] != q_lat.shape[0]:
            raise ValueError(f"page_table must be [B, max_pages], got {tuple(page_table.shape)}")
    return base, _operands(q_lat, q_rope, kv, pe, v_dim)


def _kernel_operands(parts, N: int, H: int):
    """``(q_nope [N, H, 512], q_pe [N, H, 64], ckv, kpe)`` as the kernel takes them
    (:func:`_kernel_ready`); after the empty-call checks, so an empty call copies nothing."""
    return (
        _kernel_ready(parts.q_main.reshape(N, H, CKV_DIM)),
        _kernel_ready(parts.q_tail.reshape(N, H, KPE_DIM)),
        _kernel_ready(parts.k_main),
        _kernel_ready(parts.k_tail),
    )


def _operands(q_lat, q_rope, kv, pe, v_dim):
    from .common import split_parts

    parts = split_parts(q_lat, q_rope, kv, pe, v_dim)
    if parts.q_tail is None:
        raise ValueError("attention backend 'flashinfer' needs the rope part (64 columns); this call has none")
    dims = (parts.k_main.shape[-1], parts.k_tail.shape[-1])
    if dims != (CKV_DIM, KPE_DIM):
        raise ValueError(
            f"attention backend 'flashinfer' runs latent {CKV_DIM} + rope {KPE_DIM} columns "
            f"(FlashInfer's MLA kernels), this call has {dims[0]} + {dims[1]}"
        )
    if v_dim > CKV_DIM:
        raise ValueError(f"attention backend 'flashinfer': values are the {CKV_DIM} latent columns, v_dim={v_dim}")
    _check_kernel_inputs(q_lat, kv, pe)
    return parts


def _check_kernel_inputs(q_lat, kv, pe) -> None:
    """What only the real kernel needs: CUDA tensors of one 16-bit dtype."""
    if q_lat.dtype not in SUPPORTED_DTYPES or kv.dtype != q_lat.dtype or (pe is not None and pe.dtype != kv.dtype):
        raise ValueError(
            f"attention backend 'flashinfer' takes float16/bfloat16 queries and caches of one dtype, "
            f"got q {q_lat.dtype}, cache {kv.dtype}"
        )
    if not q_lat.is_cuda or not kv.is_cuda:
        raise ValueError("attention backend 'flashinfer' needs CUDA tensors")


def _host_counts(kv_lens, causal, B, S, T, lens_stripe=(1, 0), host_lens=None) -> torch.Tensor:
    """[B, S] visible key counts on the host: one device-to-host copy at most (none with
    ``host_lens``, the host's copy of the count ``kv_lens`` holds).

    ``lens_stripe=(c, r)``: ``kv_lens`` are global counts of which rank r of c holds
    ``(n + c - 1 - r) // c`` (the kernels' convention for device counts).
    """
    from dcp_pass.runtime.decode.layout import local_length

    lens = torch.full((B,), T, dtype=torch.int64) if kv_lens is None else kv_lens
    if host_lens is not None:
        lens = torch.tensor([int(host_lens)], dtype=torch.int64)
    q_pos = causal.q_pos if causal is not None else None
    if isinstance(lens, torch.Tensor) and lens.device.type != "cpu":
        lens = torch.broadcast_to(lens.reshape(-1), (B,))
        if q_pos is not None and q_pos.device == lens.device:
            both = torch.cat([lens.long(), torch.broadcast_to(q_pos.long(), (B, S)).reshape(-1)]).cpu()
            lens, q_pos = both[:B], both[B:].view(B, S)
        else:
            lens = lens.cpu()
    lens = torch.broadcast_to(torch.as_tensor(lens).reshape(-1), (B,))
    c, r = (int(x) for x in lens_stripe)
    if (kv_lens is not None or host_lens is not None) and c > 1:
        lens = local_length(lens.to(torch.int64).clamp(min=0), c, r)
    if causal is None:
        return visible_counts(lens, S, T)
    return visible_counts(lens, S, T, q_pos, causal.cp_world, causal.cp_rank)


def _device_empty(kv_lens, lens_stripe, T, B, S) -> torch.Tensor:
    """[B, S, 1] bool on the device: rows whose rank holds no key of the device counts."""
    from dcp_pass.runtime.decode.layout import local_length

    c, r = (int(x) for x in lens_stripe)
    lens = kv_lens.reshape(-1).to(torch.int64).clamp(min=0)
    local = local_length(lens, c, r) if c > 1 else lens
    return torch.broadcast_to((local.clamp(max=int(T)) == 0).view(-1, 1, 1), (B, S, 1))


def _finish(out_full, lse_full, counts, B, S, H, v_dim, base, out, lse_out, dead=None):
    """FlashInfer's [N, H, 512] / base-2 [N, H] -> the contract's shapes, base and empty rows
    (``dead``: the empty rows found on the device, [B, S, 1]; else from the host counts)."""
    o = out_full.view(B, S, H, CKV_DIM)[..., :v_dim]
    lse = lse_full.view(B, S, H)
    if base == "e":
        lse = lse * LN2
    if dead is None:
        empty = counts == 0
        if bool(empty.any()):
            dead = empty.to(o.device).view(B, S, 1)
    if dead is not None:
        lse = lse.masked_fill(dead, float("-inf"))
        o = o.masked_fill(dead.unsqueeze(-1), 0.0)
    if out is None:
        out = o if o.is_contiguous() else o.contiguous()
    else:
        out.copy_(o)
    if lse_out is None:
        lse_out = lse.contiguous()
    else:
        lse_out.copy_(lse)
    return out, lse_out


def _empty_result(q_lat, v_dim, out, lse_out):
    B, S, H, _ = q_lat.shape
    if out is None:
        out = q_lat.new_zeros(B, S, H, v_dim)
    else:
        out.zero_()
    if lse_out is None:
        lse_out = torch.full((B, S, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    else:
        lse_out.fill_(float("-inf"))
    return out, lse_out


def _work_per_request(H: int) -> int:
    return -(-H // _ROWS_PER_TILE)


# --------------------------------------------------------------------------------------
# dense and paged entry points
# --------------------------------------------------------------------------------------
def _run_dense(view, out, lse_out) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer MLA over dense shards ``kv [B, T, Dk]`` / ``pe [B, T, 64]`` (see the module doc)."""
    q_lat, q_rope, kv, pe, v_dim, scale = view.q_lat, view.q_rope, view.kv, view.pe, view.v_dim, view.scale
    kv_lens, causal, lens_stripe = view.kv_lens, view.causal, view.lens_stripe
    base, parts = _prepare(q_lat, q_rope, kv, pe, v_dim, view.mask, view.lse_base)
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    if B == 0 or S * H == 0 or T == 0:
        return _empty_result(q_lat, v_dim, out, lse_out)
    host_lens, operands, chunks = view.host_lens, None, None
    if host_lens is not None and causal is None:
        operands = _kernel_operands(parts, B * S, H)
        chunks = _dense_chunks(operands, B, S, H, T)
        if len(chunks) == 1:
            return _run_dense_planned(view, operands, base, out, lse_out)
    if _capturing():
        _refuse_capture(
            "has no host copy of its key counts"
            if host_lens is None
            else "has a causal cap"
            if causal is not None
            else f"needs {len(chunks)} plans"
        )
    counts = _host_counts(kv_lens, causal, B, S, T, lens_stripe, host_lens=host_lens)
    if not bool((counts > 0).any()):
        return _empty_result(q_lat, v_dim, out, lse_out)
    if operands is None:  # after the empty-call checks: an empty call copies nothing
        operands = _kernel_operands(parts, B * S, H)
        chunks = _dense_chunks(operands, B, S, H, T)
    q_nope, q_pe, ckv, kpe = operands

    runner = _runner(q_lat.device)
    dev = q_lat.device
    out_full = torch.empty(B * S, H, CKV_DIM, dtype=q_lat.dtype, device=dev)
    lse_full = torch.empty(B * S, H, dtype=torch.float32, device=dev)
    flat_counts = counts.reshape(-1).to(torch.int32)
    for b0, b1 in chunks:
        n0, n1 = b0 * S, b1 * S
        n = n1 - n0
        indptr = torch.arange(n + 1, dtype=torch.int32)

        def kv_indices(rows=b1 - b0):  # page of request n: its row
            return torch.arange(rows, dtype=torch.int32, device=dev).repeat_interleave(S)

        lens = flat_counts[n0:n1].contiguous()
        key = None
        if len(chunks) == 1:  # the layers of one step share it: plan once
            key = ("dense", n, S, H, T, q_lat.dtype, kv.dtype, float(scale), lens.numpy().tobytes())
        _plan(runner, key, indptr, indptr, kv_indices, lens, H, T, scale, q_lat.dtype, kv.dtype)
        runner.wrapper.run(
            q_nope[n0:n1],
            q_pe[n0:n1],
            ckv[b0:b1],
            kpe[b0:b1],
            out=out_full[n0:n1],
            lse=lse_full[n0:n1],
            return_lse=True,
        )
    return _finish(out_full, lse_full, counts, B, S, H, v_dim, base, out, lse_out)


def _dense_chunks(operands, B: int, S: int, H: int, T: int) -> List[Tuple[int, int]]:
    """The row chunks of a dense call, each within one plan's limits (row_chunks)."""
    return row_chunks([S] * B, [S * T] * B, _work_per_request(H), max_rows=_rows_within_span(operands[2:]))


def _dense_planner(runner: _Runner, B: int, S: int, H: int, T: int, lens_stripe, scale, q_dtype, kv_dtype):
    """plan(count): the runner's plan for a step of global key count `count` (every row
    alike, no causal cap): one request per (row, query token), each row one page of T keys."""
    n = B * S
    indptr = torch.arange(n + 1, dtype=torch.int32)
    pages = torch.arange(B, dtype=torch.int32).repeat_interleave(S)

    def plan(count: int) -> None:
        lens = _host_counts(None, None, B, S, T, lens_stripe, host_lens=count).reshape(-1).to(torch.int32)
        _plan(
            runner,
            ("step", lens.numpy().tobytes()),
            indptr,
            indptr,
            pages,
            lens.contiguous(),
            H,
            T,
            scale,
            q_dtype,
            kv_dtype,
        )

    return plan


def _run_dense_planned(view, operands, base, out, lse_out) -> Tuple[torch.Tensor, torch.Tensor]:
    """A dense call whose key count is known on the host (``view.host_lens``) and fits one
    plan: its plan shape's fixed-buffer wrapper, planned by the graph's planner
    (runtime/decode/step_count.py), so the launches may be captured; empty rows are found on
    the device, where a replay's counts are."""
    from dcp_pass.runtime.decode import step_count

    q_lat, kv, scale = view.q_lat, view.kv, view.scale
    B, S, H, _ = q_lat.shape
    T = kv.shape[1]
    shape = ("dense", B, S, H, T, tuple(view.lens_stripe), float(scale), q_lat.dtype, kv.dtype)
    runner = _graph_runner(q_lat.device, shape, B * S)
    if _capturing():
        if not step_count.planned(shape):
            _refuse_capture("was not run once outside capture first (its plan is made before each replay)")
    else:
        if runner.step_plan is None:  # one per wrapper: its plan shape is the wrapper's
            runner.step_plan = _dense_planner(runner, B, S, H, T, view.lens_stripe, scale, q_lat.dtype, kv.dtype)
        step_count.register(shape, runner.step_plan)
        runner.step_plan(int(view.host_lens))
    out_full = torch.empty(B * S, H, CKV_DIM, dtype=q_lat.dtype, device=q_lat.device)
    lse_full = torch.empty(B * S, H, dtype=torch.float32, device=q_lat.device)
    runner.wrapper.run(*operands, out=out_full, lse=lse_full, return_lse=True)
    dead = _device_empty(view.kv_lens, view.lens_stripe, T, B, S)
    return _finish(out_full, lse_full, None, B, S, H, view.v_dim, base, out, lse_out, dead=dead)


def _run_paged(view, out, lse_out) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer MLA over page pools ``[num_pages, P, Dk]`` and ``page_table [B, max_pages]``."""
    q_lat, q_rope, kv_pool, pe_pool, v_dim, scale = view.q_lat, view.q_rope, view.kv, view.pe, view.v_dim, view.scale
    page_table, kv_lens, causal, lens_stripe = view.page_table, view.kv_lens, view.causal, view.lens_stripe
    base, parts = _prepare(q_lat, q_rope, kv_pool, pe_pool, v_dim, view.mask, view.lse_base, page_table)
    B, S, H, _ = q_lat.shape
    P, max_pages = kv_pool.shape[1], page_table.shape[1]
    if B == 0 or S * H == 0 or kv_pool.shape[0] == 0 or max_pages == 0:
        return _empty_result(q_lat, v_dim, out, lse_out)
    counts = _host_counts(kv_lens, causal, B, S, P * max_pages, lens_stripe)
    if not bool((counts > 0).any()):
        return _empty_result(q_lat, v_dim, out, lse_out)

    q_nope, q_pe, ckv, kpe = _kernel_operands(parts, B * S, H)
    for pool in (ckv, kpe):
        if _span(pool, (0, 1)) > SPAN_CAP:
            raise ValueError(
                f"attention backend 'flashinfer': a page pool of {pool.numel()} elements spans more "
                f"than 2**32; FlashInfer's MLA kernel forms 32-bit offsets into it"
            )
    rows = torch.arange(B, dtype=torch.int64).repeat_interleave(S)
    indptr_all, flat_all = paged_request_pages(counts.reshape(-1), rows, P, max_pages)
    per_row_pages = (indptr_all[S::S].long() - indptr_all[:-1:S].long()).tolist()
    chunks = row_chunks([S] * B, [p * P for p in per_row_pages], _work_per_request(H))

    runner = _runner(q_lat.device)
    dev = q_lat.device
    table = page_table.to(device=dev).reshape(-1)
    flat_dev = flat_all.to(dev, non_blocking=True)
    out_full = torch.empty(B * S, H, CKV_DIM, dtype=q_lat.dtype, device=dev)
    lse_full = torch.empty(B * S, H, dtype=torch.float32, device=dev)
    flat_counts = counts.reshape(-1).to(torch.int32)
    qo_all = torch.arange(B * S + 1, dtype=torch.int32)
    for b0, b1 in chunks:
        n0, n1 = b0 * S, b1 * S
        p0, p1 = int(indptr_all[n0]), int(indptr_all[n1])
        kv_indptr = (indptr_all[n0 : n1 + 1] - p0).contiguous()
        kv_indices = table.index_select(0, flat_dev[p0:p1]).to(torch.int32)
        if p1 == p0:  # every request of the chunk is empty: FlashInfer still wants an index array
            kv_indices = torch.zeros(1, dtype=torch.int32, device=dev)
        _plan(
            runner,
            None,
            qo_all[: n1 - n0 + 1].contiguous(),
            kv_indptr,
            kv_indices,
            flat_counts[n0:n1].contiguous(),
            H,
            P,
            scale,
            q_lat.dtype,
            kv_pool.dtype,
        )
        runner.wrapper.run(
            q_nope[n0:n1], q_pe[n0:n1], ckv, kpe, out=out_full[n0:n1], lse=lse_full[n0:n1], return_lse=True
        )
    return _finish(out_full, lse_full, counts, B, S, H, v_dim, base, out, lse_out)
