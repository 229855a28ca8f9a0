"""The runtime modules' paths of the last release (before decode/ and compose/) still import,
for one release: the same module objects as the new paths, with a DeprecationWarning that
names the new path. Each old path is imported afresh in a subprocess, so that the warning is
seen whatever this process imported before."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import dcp_pass.runtime as runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OLD_PATHS = sorted(runtime.MOVED) + ["kernels.mla_attention", "kernels.common", "kernels.mla_wide",
                                     "kernels.merge_triton"]

PROBE = r"""
import importlib, json, sys, warnings
out = {}
for old in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module("dcp_pass.runtime." + old)
    top, _, rest = old.partition(".")
    from dcp_pass.runtime import MOVED
    new = "dcp_pass.runtime." + MOVED[top] + ("." + rest if rest else "")
    out[old] = dict(same=module is importlib.import_module(new), name=module.__name__, new=new,
                    warnings=[str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)])
from dcp_pass.runtime.comm import exchange_a2a
from dcp_pass.runtime import layout
out["from-import"] = exchange_a2a is importlib.import_module("dcp_pass.runtime.decode.comm").exchange_a2a and \
    layout is importlib.import_module("dcp_pass.runtime.decode.layout")
print(json.dumps(out))
"""


def test_every_old_path_imports_the_same_module_with_a_warning():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PROBE, *OLD_PATHS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("from-import") is True
    assert set(out) == set(OLD_PATHS)
    for old, rec in out.items():
        assert rec["same"] and rec["name"] == rec["new"], (old, rec)
        assert any(f"dcp_pass.runtime.{old} moved to {rec['new']}" in w for w in rec["warnings"]), (old, rec)


def test_the_new_paths_are_what_the_old_ones_name():
    import importlib

    for old, new in runtime.MOVED.items():
        assert importlib.util.find_spec("dcp_pass.runtime." + new) is not None, new
        assert not os.path.exists(os.path.join(os.path.dirname(runtime.__file__), old + ".py")), old
