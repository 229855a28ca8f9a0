"""Helpers for running real multi-process groups in tests, demos and benchmarks."""
from dcp_pass.testing.multiproc import run_ranks

__all__ = ["run_ranks"]
