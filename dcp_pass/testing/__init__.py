"""Helpers for tests of DCP: real multi-process groups (`run_ranks`), and graph-diff
pins of a model's rewrite (`graph_stages`, `readable_code`)."""

from dcp_pass.testing.multiproc import Checks, run_ranks


def __getattr__(name):
    # the graph helpers pull in the compiler stack; import them only when asked for
    if name in ("graph_stages", "readable_code", "fake_process_group"):
        from dcp_pass.testing import graphs

        return getattr(graphs, name)
    raise AttributeError(name)


__all__ = ["Checks", "run_ranks", "graph_stages", "readable_code", "fake_process_group"]
