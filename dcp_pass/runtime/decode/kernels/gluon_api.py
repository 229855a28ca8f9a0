"""The Gluon (Triton's explicit-layout dialect) names the Hopper MLA kernels use, in one place.

Gluon ships with Triton >= 3.5 (torch 2.11's Triton 3.6 has it) and its API moves between
releases: 3.6 calls the async copy ``async_copy_global_to_shared`` and the CTA barrier
``thread_barrier``, later releases ``async_load`` and ``barrier``; the kernels call the
aliases below. ``HAS_GLUON`` is False where the import fails, and nothing Gluon runs then.
"""
from __future__ import annotations

try:
    import triton
    from triton.compiler.errors import CompilationError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.runtime.errors import OutOfResources

    async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton build
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "CompilationError", "OutOfResources", "async_load", "barrier", "cp", "fence_async_shared",
           "gl", "gluon", "mbarrier", "triton", "warpgroup_mma", "warpgroup_mma_wait"]
