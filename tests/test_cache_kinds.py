"""The cache kinds: one frozen record per kind, each in its own module of
dcp_pass/rewrites/cache_kinds/, all in one table that the pass reads."""
import dataclasses
import importlib
import operator
import os
import pkgutil

import pytest
import torch
import torch.fx as fx

from dcp_pass.rewrites import cache_kinds
from dcp_pass.rewrites.cache_reads import CacheKind, ReadRefused, trace_cache_read
from dcp_pass.rewrites.cache_reads import cache_kinds as table_read
from dcp_pass.state import shards
from dcp_pass.state.store import ShardKind


def test_each_kind_module_defines_one_record_and_the_table_holds_them_all():
    modules = sorted(info.name for info in pkgutil.iter_modules(cache_kinds.__path__))
    defined = []
    for name in modules:
        module = importlib.import_module(f"{cache_kinds.__name__}.{name}")
        own = [v for v in vars(module).values() if isinstance(v, CacheKind)]
        assert len(own) == 1, (name, own)
        defined.append(own[0])
    assert modules == ["flat", "paged", "ring_entries", "static_cache"]
    assert set(cache_kinds.CACHE_KINDS) == set(defined) and len(cache_kinds.CACHE_KINDS) == len(defined)
    # a module buffer's own forms are tried first: a window ring then entries before rows by position
    assert [k.name for k in cache_kinds.CACHE_KINDS[:2]] == ["ring_entries", "flat"]
    assert table_read() is cache_kinds.CACHE_KINDS  # what the tracer and the rewrites read


def test_records_are_frozen_and_name_their_run_time_half():
    for kind in cache_kinds.CACHE_KINDS:
        assert isinstance(kind.shards, ShardKind) and kind.shards.name == kind.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            kind.words = "changed"  # type: ignore[misc]
    assert {k.shards for k in cache_kinds.CACHE_KINDS} == {shards.FLAT, shards.PAGED, shards.STATIC_CACHE,
                                                           shards.RING_ENTRIES}


def test_records_are_passed_not_looked_up_by_name():
    """Reads, writes and conversions hold the records themselves: no code outside the records'
    own definitions names a kind by its string."""
    assert cache_kinds.PAGED.write_conversions[0][0] is cache_kinds.FLAT
    root = os.path.dirname(os.path.dirname(os.path.dirname(cache_kinds.__file__)))
    own = (os.path.dirname(cache_kinds.__file__), shards.__file__)  # the records' compile- and run-time halves
    for dirpath, _, names in os.walk(root):
        if dirpath.startswith(own[0]) or "models" in dirpath.split(os.sep):
            continue  # the model zoo's "paged" is a form of attention, not a kind
        for name in names:
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and path != own[1]:
                text = open(path).read()
                for quoted in ('"flat"', '"paged"', '"static_cache"', '"ring_entries"', "CACHE_KINDS["):
                    assert quoted not in text, (path, quoted)


def test_what_each_kind_allows_at_run_time():
    allows = {k.name: (k.shards.takes_fp8_rows, k.shards.batch_reorderable, k.shards.resettable,
                       k.shards.installed_at_first_call) for k in cache_kinds.CACHE_KINDS}
    assert allows == {"flat": (True, True, False, False), "paged": (False, False, False, False),
                      "static_cache": (False, True, True, True), "ring_entries": (False, True, False, False)}


def test_no_module_registers_a_kind_behind_the_tables_back():
    """The tables the kinds replaced are gone: nothing appends to a module-level hook list."""
    root = os.path.dirname(os.path.dirname(cache_kinds.__file__))
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                for gone in ("READ_BASES", "WRITE_FORMS", "CACHE_LAYOUTS", "WRITE_CONVERSIONS", "LOCAL_READS",
                             "STRIPE_CHECKS", "SHARD_MAKERS"):
                    assert gone not in text, (name, gone)


def _graph_reading(source: str, shape: tuple, index: tuple):
    """A graph whose input (named by Dynamo's `source`) is read through `input[index]`."""
    graph = fx.Graph()
    cache = graph.placeholder("cache")
    cache.meta.update(dcp_source=source, example_value=torch.zeros(shape))
    read = graph.call_function(operator.getitem, (cache, index))
    read.meta["example_value"] = torch.zeros(shape)[index]
    return read


def test_a_traced_read_holds_the_record_of_the_kind_that_knows_its_tensor():
    (read,) = trace_cache_read(_graph_reading("L['self']._buffers['kv_cache']", (2, 16, 8), (slice(None, 2),)))
    assert read.kind is cache_kinds.FLAT
    # a static cache tensor with one kv head has the layout of a flat cache with a head axis, but
    # its kind has no rank-local view read (its own per-head forms read it whole): refused, named
    source = "L['kwargs']['cache'].layers[0].keys"
    with pytest.raises(ReadRefused, match=r"cache\.layers\.0\.keys is a Hugging Face static cache tensor, read "
                                          r"whole by its own attention forms"):
        trace_cache_read(_graph_reading(source, (2, 1, 16, 8), (slice(None), 0)))
