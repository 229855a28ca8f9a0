"""What the two Gluon MLA kernels share: ``mla_gluon.py`` (the lock-step form) and
``mla_gluon_roles.py`` (the role-split form) import it, neither imports the other.

The Gluon imports and the aliases of names that moved between Triton releases, DeepSeek's
column counts, and the device-side helper both kernels inline for a split's key range.
"""
from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5 (torch 2.11's Triton 3.6 has it); nothing here runs without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    # names that moved between Triton releases (3.6: async_copy_global_to_shared,
    # thread_barrier; later: async_load, barrier); the kernels call these aliases
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton build
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "D_LAT", "D_ROPE"]

D_LAT = 512  # latent columns (= values) the kernels are written for
D_ROPE = 64  # rope columns


def _split_keys_src(LENS, b, lens_sb, lens_c, lens_r, T, pid_sp, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_LENS: gl.constexpr):
    """This split's keys [start, end): the request's local count (rank r's share of a global
    count under lens_stripe (c, r), clamped so nothing wraps in int32) cut into NUM_SPLITS
    whole-tile pieces. Both kernel forms take it."""
    if HAS_LENS:
        n_glob = gl.minimum(gl.maximum(gl.load(LENS + b * lens_sb), 0), T * lens_c).to(gl.int32)  # no int32 wrap
        kv_len = gl.minimum((n_glob + (lens_c - 1 - lens_r)) // lens_c, T)
    else:
        kv_len = T
    split_len = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_sp * split_len
    return start, gl.minimum(start + split_len, kv_len)


if HAS_GLUON:
    _split_keys = gluon.jit(_split_keys_src)
