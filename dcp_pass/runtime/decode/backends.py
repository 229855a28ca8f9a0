"""The comm backends and attention backends of DCP, one table each.

Every chooser reads these tables: option validation (dcp_pass/options.py), plan
resolution (dcp_pass/backend.py), the rewrite's exchange (rewrites/attention.py),
the shard-local attention op (runtime/decode/ops.py), extend (runtime/compose/extend.py),
speculative verification (runtime/compose/speculative.py) and the benchmarks. A new backend
is one entry here (vLLM's attention backend registry is the model).

* ``COMM_BACKENDS``: name -> :class:`CommBackend` (head-sharded exchange, the method
  the replicated-heads exchange uses, what keeps it from running on given platform
  facts, description). Insertion order is the default's preference order. Defined in
  runtime/decode/comm.py beside the exchanges it names, re-exported here.
* ``ATTENTION_BACKENDS``: name -> :class:`AttentionBackend` (availability check,
  dense and paged run functions, native LSE base). ``"auto"`` is not an entry: it is
  resolved per call by :func:`resolve_attention_backend`.

The runtime never imports the rewrites: this module imports only runtime code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from dcp_pass.runtime.decode.comm import (COMM_BACKENDS, DEFAULT_COMM_PREFERENCE, CommBackend,  # noqa: F401
                                          comm_backend_blockers)

__all__ = [
    "CommBackend",
    "AttentionBackend",
    "AttentionBackendUnavailable",
    "COMM_BACKENDS",
    "ATTENTION_BACKENDS",
    "AUTO",
    "attention_backend_names",
    "attention_lse_base",
    "comm_backend_blockers",
    "resolve_attention_backend",
]


# --------------------------------------------------------------------------------------
# attention backends

AUTO = "auto"


class AttentionBackendUnavailable(ValueError):
    """An attention backend was asked for where it cannot run."""


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (device, dtype) -> None when it can run there, else the reason it cannot
    available: Callable[[torch.device, Optional[torch.dtype]], Optional[str]]
    # run(q_lat, q_rope, kv, pe, v_dim, scale, mask=None, kv_lens=None, lse_base="e", causal=None)
    #   -> (out [B,S,H,v_dim], lse [B,S,H])
    run: Optional[Callable[..., Any]]
    # run_paged(q_lat, q_rope, kv_pool, pe_pool, page_table, kv_lens, v_dim, scale, mask=None,
    #   lse_base="e", causal=None) -> (out, lse)
    run_paged: Optional[Callable[..., Any]]
    lse_base: str  # the base its LSE comes in natively; the plan's default LSE base
    description: str
    # False: it cannot run inside CUDA-graph capture (the pass turns cudagraphs "auto" off)
    capturable: bool = True
    # False: it refuses an additive score mask (the pass refuses masked layers at compile)
    takes_mask: bool = True
    # True: its calls only allocate, take views and launch Triton kernels through
    # kernels.common.launch, so the op may replay them (runtime/decode/replay.py). A backend
    # that launches anything else (a C++ extension, a library call) must stay False: a
    # replay would silently skip what the recording cannot see.
    replayable: bool = False


def _triton_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs CUDA tensors, the model is on {device.type}"
    return None


def _torch_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    return None


def _flashinfer_available(device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    from dcp_pass.runtime.decode.kernels.flashinfer_mla import flashinfer_unavailable

    return flashinfer_unavailable(device, dtype)


# Kernel imports stay lazy: importing the tables (options validation) must not import Triton.
def _triton_run(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.mla_attention import mla_attention

    # the kernels' dispatcher: Triton where the shapes are supported, the reference otherwise
    return mla_attention(*args, **kwargs)


def _triton_run_paged(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.mla_attention import mla_attention_paged

    return mla_attention_paged(*args, **kwargs)


def _torch_run(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.mla_attention import mla_attention_reference

    return mla_attention_reference(*args, **kwargs)


def _torch_run_paged(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.mla_attention import mla_attention_reference_paged

    return mla_attention_reference_paged(*args, **kwargs)


def _flashinfer_run(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.flashinfer_mla import mla_attention_flashinfer

    return mla_attention_flashinfer(*args, **kwargs)


def _flashinfer_run_paged(*args, **kwargs):
    from dcp_pass.runtime.decode.kernels.flashinfer_mla import mla_attention_flashinfer_paged

    return mla_attention_flashinfer_paged(*args, **kwargs)


# Insertion order gives options.ATTN_BACKENDS (after "auto").
ATTENTION_BACKENDS: Dict[str, AttentionBackend] = {
    "triton": AttentionBackend(
        "triton", _triton_available, _triton_run, _triton_run_paged, "e",
        "split-KV flash-decoding Triton kernel (runtime/decode/kernels/mla_attention.py)",
        replayable=True,
    ),
    "flashinfer": AttentionBackend(
        "flashinfer", _flashinfer_available, _flashinfer_run, _flashinfer_run_paged, "2",
        "FlashInfer's BatchMLAPagedAttentionWrapper (runtime/decode/kernels/flashinfer_mla.py): "
        "host-side plan, no additive masks",
        capturable=False, takes_mask=False,
    ),
    "torch": AttentionBackend(
        "torch", _torch_available, _torch_run, _torch_run_paged, "e",
        "torch reference (runs everywhere; the fp32 checking mode)",
    ),
}

FALLBACK_ATTENTION = "torch"  # runs everywhere


def attention_backend_names() -> tuple:
    """Every name option 'attn_backend' accepts: "auto" then the table's names."""
    return (AUTO,) + tuple(ATTENTION_BACKENDS)


def _auto_choice(device: torch.device, dtype: Optional[torch.dtype], fp32_reference: bool) -> str:
    # fp32 caches are a checking mode: the Triton kernel runs them with IEEE fp32 dots on
    # tiles shrunk to fit shared memory (72.7 ms vs 6.5 ms per step for the 4-layer
    # V3-sized model, docs/performance.md), the reference's cuBLAS GEMMs are far faster
    if torch.device(device).type == "cuda" and not (fp32_reference and dtype == torch.float32):
        return "triton"
    return "torch"


def attention_lse_base(requested: str) -> str:
    """The native LSE base of `requested` ("auto": that of every backend auto can pick)."""
    if requested == AUTO:
        bases = {ATTENTION_BACKENDS[n].lse_base for n in ("triton", "torch")}
        assert len(bases) == 1, bases
        return bases.pop()
    return ATTENTION_BACKENDS[requested].lse_base


def resolve_attention_backend(
    requested: Optional[str],
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    *,
    strict: bool = True,
) -> AttentionBackend:
    """The attention backend that runs a call on `device` with cache dtype `dtype`.

    * ``"auto"``: Triton on CUDA for 16-bit caches, the torch reference for fp32 caches
      (a checking mode) and off CUDA: what the compiled op runs.
    * ``None``: Triton on CUDA whatever the dtype, the reference elsewhere: the default
      of the runtime features (extend, speculative verification), which have no fp32
      checking mode.
    * a table name: that backend; where it cannot run (or for an unknown name),
      ``strict`` raises :class:`AttentionBackendUnavailable` saying why, otherwise the
      reference runs.
    """
    if requested is None or requested == AUTO:
        return ATTENTION_BACKENDS[_auto_choice(device, dtype, fp32_reference=requested == AUTO)]
    if requested not in ATTENTION_BACKENDS:
        if not strict:
            return ATTENTION_BACKENDS[FALLBACK_ATTENTION]
        raise AttentionBackendUnavailable(
            f"unknown attention backend {requested!r}; valid names are "
            f"{', '.join(map(repr, attention_backend_names()))} (or None)")
    entry = ATTENTION_BACKENDS[requested]
    reason = entry.available(torch.device(device), dtype)
    if reason is None and entry.run is not None:
        return entry
    if strict:
        raise AttentionBackendUnavailable(
            f"attention backend {requested!r} {reason or 'cannot run: it has no run function'}")
    return ATTENTION_BACKENDS[FALLBACK_ATTENTION]
