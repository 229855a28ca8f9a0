"""Helpers for running real multi-process groups in tests, demos and benchmarks."""
from dcp_pass.testing.multiproc import Checks, run_ranks

__all__ = ["Checks", "run_ranks"]
