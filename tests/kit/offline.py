"""Offline sm_90 compiles for the kernel tests: the benchmarks' compile scripts loaded as
modules, and the decorator that runs such a test without Triton's interpreter.

Triton compiles for Hopper on a CPU-only machine (ptxas and cuobjdump ship in its wheel):
``benchmarks/offline_gluon.py`` and ``offline_wide.py`` report registers, spills, shared
memory and the MMA instructions of a kernel, which tests pin without a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def offline_module(name: str):
    """benchmarks/<name>.py, one of the offline sm_90 compile scripts, or skip where they
    cannot run (no Gluon in this Triton, or no ptxas / cuobjdump in its wheel)."""
    from dcp_pass.runtime.decode.kernels.gluon.common import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton ships no ptxas / cuobjdump")
    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(name, os.path.join(bench, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compiles_offline(test):
    """For a test that compiles kernels for sm_90 with Triton's real compiler. Under
    TRITON_INTERPRET=1 (the usual way to run Triton on a CPU) a cold compile fails: the
    variable is read when a kernel is decorated, so it cannot be switched off in this
    process. Then the test runs in a fresh pytest process without it, and reports as
    that run did (passed, skipped with its reason, or failed with its output)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return test(*args, **kwargs)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             f"{os.path.abspath(sys.modules[test.__module__].__file__)}::{test.__name__}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        tail = (done.stdout + done.stderr)[-6000:]
        if done.returncode == 0 and " skipped" in done.stdout and " passed" not in done.stdout:
            reasons = [line.split(": ", 1)[-1] for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
            pytest.skip(f"without TRITON_INTERPRET: {reasons[0] if reasons else 'skipped'}")
        assert done.returncode == 0 and "1 passed" in done.stdout, f"run without TRITON_INTERPRET failed:\n{tail}"

    return run
