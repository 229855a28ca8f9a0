"""The measured path table (dcp_pass/runtime/decode/kernels/path_table.py, issue #14 item 3).

The committed table must be what benchmarks/make_path_table.py makes of the committed H200
results, and the choice at every measured shape must be the path measured fastest there.
"""
import importlib.util
import os

import pytest

from dcp_pass.runtime.decode.kernels import path_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generator():
    spec = importlib.util.spec_from_file_location("make_path_table", os.path.join(ROOT, "benchmarks", "make_path_table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_table_is_the_benchmarks_results():
    assert [tuple(r) for r in _generator().rows()] == [tuple(r) for r in path_table.MEASURED]


@pytest.mark.parametrize("row", path_table.MEASURED, ids=lambda r: f"{r[0]}x{r[1]}x{r[2]}")
def test_every_measured_shape_gets_its_fastest_path(row):
    h, b, t, ms = row
    for candidates in (("split", "wide"), ("split", "wide", "flashinfer"), ("wide", "flashinfer"),
                       ("split", "wide", "gluon")):
        timed = {p: v for p, v in ms.items() if p in candidates}
        if len(timed) >= 2:
            assert path_table.fastest(h, b, t, candidates) == min(timed, key=timed.get)


def test_nearest_shape_and_what_the_dispatcher_gets():
    triton = ("split", "wide")
    assert path_table.fastest(16, 8, 4096, triton) == "split"  # memory-bound: nearest is 64 rows
    assert path_table.fastest(64, 1, 8192, triton) == "split"  # measured slower wide at 64 heads
    assert path_table.fastest(128, 1, 16384, triton) == "wide"
    assert path_table.fastest(512, 64, 1 << 20, triton) == "wide"
    assert path_table.fastest(128, 8, 32768, ("torch", "split")) is None  # nothing timed both
    # the Gluon one-read kernel measured fastest from 64 rows at every timed shape (under 64
    # rows mla_gluon.gluon_preferred never offers it: its tile is 64 rows)
    three = ("split", "wide", "gluon")
    assert path_table.fastest(64, 8, 32768, three) == "gluon"
    assert path_table.fastest(128, 32, 1 << 20, three) == "gluon"
