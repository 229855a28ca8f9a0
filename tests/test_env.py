"""dcp_pass/env.py: the one module that reads dcp_pass's environment variables."""
from __future__ import annotations

import os
import re

import pytest
import torch

from dcp_pass import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "dcp_pass")


def _sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), f.read()


def test_every_variable_is_in_the_table_and_its_docstring():
    named = set()
    for path, text in _sources():
        named |= set(re.findall(r"\bDCP_[A-Z0-9_]+\b", text))
    assert named == set(env.VARIABLES), named ^ set(env.VARIABLES)
    for name in env.VARIABLES:
        assert f"``{name}``" in env.__doc__, name


def test_the_usage_page_lists_every_variable():
    with open(os.path.join(ROOT, "docs", "usage.md")) as f:
        rows = set(re.findall(r"^\| `(DCP_[A-Z0-9_]+)` \|", f.read(), re.M))
    assert rows == set(env.VARIABLES), rows ^ set(env.VARIABLES)


def _repository_sources():
    """(path, text) of every Python and shell file of the package, tests, benchmarks and examples."""
    for top in ("dcp_pass", "tests", "benchmarks", "examples"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".sh")):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        yield os.path.relpath(path, ROOT), f.read()


def test_every_variable_read_anywhere_is_in_the_table():
    """A DCP_ name in a string or a shell assignment anywhere in the repository (a test's
    switch, a benchmark's setting) is one of the table's: its reader and the docs know it."""
    used = {}
    for path, text in _repository_sources():
        for name in re.findall(r"""(?:["']|^|\s)(DCP_[A-Z0-9_]+)\b(?=["'=])""", text, re.M):
            used.setdefault(name, path)
    assert "DCP_TEST_FULL" in used and "DCP_FP8_READ" in used  # the scan sees tests and benchmarks
    unknown = {name: path for name, path in used.items() if name not in env.VARIABLES}
    assert unknown == {"DCP_NOPE": os.path.join("tests", "test_env.py")}  # the unknown name read() refuses


def test_no_other_module_reads_the_environment_for_them():
    readers = [path for path, text in _sources() if path != os.path.join("dcp_pass", "env.py")
               and re.search(r"(environ(\.get)?|getenv)\s*[\[(]\s*[\"']DCP_", text)]
    assert readers == []


def test_defaults_choices_and_unknown_names(monkeypatch):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert env.logs_level() == "" and env.replay_enabled() and env.mla_wide() == "" and env.mla_gluon() == ""
    assert env.agreement_timeout_s() == 120.0 and env.flashinfer_workspace_mb() == 128
    assert env.flashinfer_mla_backend() == "auto" and env.mla_tuned() == "" and env.ranks_start() == ""
    monkeypatch.setenv("DCP_LOGS", " INFO ")
    monkeypatch.setenv("DCP_REPLAY", "0")
    monkeypatch.setenv("DCP_FLASHINFER_MLA_BACKEND", "fa3")
    assert env.logs_level() == "info" and not env.replay_enabled() and env.flashinfer_mla_backend() == "fa3"
    monkeypatch.setenv("DCP_FLASHINFER_MLA_BACKEND", "fa9")
    with pytest.raises(ValueError, match="DCP_FLASHINFER_MLA_BACKEND must be one of 'auto', 'fa2', 'fa3', got 'fa9'"):
        env.flashinfer_mla_backend()
    with pytest.raises(ValueError, match="not one of dcp_pass's environment variables"):
        env.read("DCP_NOPE")


def test_the_kernel_switches_reach_the_chooser(monkeypatch):
    from dcp_pass.runtime.decode.call import CallShape
    from dcp_pass.runtime.decode.kernels import registry

    shape = CallShape(heads=128, batch=8, keys=32768, dtype=torch.float16)
    monkeypatch.delenv("DCP_MLA_WIDE", raising=False)
    assert registry.choose(shape, registry.TRITON_KERNELS).name == "wide"
    monkeypatch.setenv("DCP_MLA_WIDE", "0")
    assert registry.choose(shape, registry.TRITON_KERNELS).name == "split"
