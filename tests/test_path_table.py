"""The measured path table (dcp_pass/runtime/decode/kernels/path_table.py): the timings the chooser reads.

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
                       ("split", "wide", "gluon"), ("split", "wide", "gluon", "seesaw", "flashinfer"),
                       ("split_fp8", "wide_fp8", "gluon_fp8"), ("split_fp8", "wide_fp8")):
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
    # rows the registry never offers it: its tile is 64 rows)
    three = ("split", "wide", "gluon")
    assert path_table.fastest(64, 8, 32768, three) == "gluon"
    assert path_table.fastest(128, 32, 1 << 20, three) == "gluon"


def test_committed_call_costs_are_the_benchmarks_results():
    assert [tuple(c) for c in _generator().call_costs()] == [tuple(c) for c in path_table.CALL_COST]


def test_the_kind_of_call_decides_where_it_changes_the_order():
    """A causal cap costs the split kernel's 64-row tile 1.27x and the two-GEMM kernel 1.00x
    (benchmarks/results/masked_paths_int32_h200.json), so at 64 rows / B=8 / 32K, where plain
    calls measured split 0.179 ms vs wide 0.192 ms, a causal call is faster on wide; a mask
    row costs both about the same, so masked calls stay on split. Gluon stays fastest."""
    triton = ("split", "wide")
    assert path_table.call_kind(None, None) == "plain"
    assert path_table.call_kind(object(), None) == "mask"
    assert path_table.call_kind(object(), object()) == "causal"
    assert path_table.fastest(64, 8, 32768, triton) == "split"
    assert path_table.fastest(64, 8, 32768, triton, "mask") == "split"
    assert path_table.fastest(64, 8, 32768, triton, "causal") == "wide"
    assert path_table.fastest(64, 32, 131072, triton, "causal") == "wide"
    assert path_table.fastest(128, 8, 32768, triton, "causal") == "wide"
    assert path_table.fastest(64, 8, 32768, ("split", "wide", "gluon"), "causal") == "gluon"
    assert path_table.call_cost("causal", "split", 16) == 1.022  # memory-bound rows: a few per cent
    assert path_table.call_cost("causal", "flashinfer", 128) == 1.0  # not measured: its plain time
    with pytest.raises(ValueError, match="call must be one of"):
        path_table.fastest(64, 8, 32768, triton, "masked")


def test_bf16_and_fp8_keys_never_mix():
    """Every measured shape times the fp8 kernels on fp8 rows under keys of their own: no key
    of one cache dtype is the other's (the chooser asks for one set or the other)."""
    fp8 = {"split_fp8", "wide_fp8", "gluon_fp8"}
    timed = [set(ms) & fp8 for _, _, t, ms in path_table.MEASURED if t >= 32768]
    assert len(timed) == 12 and all(keys == fp8 for keys in timed)  # 16/64/128 heads, B 8/32, 32K/128K keys
    assert path_table.fastest(128, 8, 131072, ("gluon", "seesaw")) == "seesaw"  # measured 0.573 vs 0.602 ms
    assert path_table.fastest(64, 8, 32768, ("gluon", "seesaw")) == "gluon"  # 0.097 vs 0.105
    assert path_table.fastest(128, 8, 131072, ("wide_fp8", "gluon_fp8")) == "gluon_fp8"
