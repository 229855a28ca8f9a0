"""What `pip install -e .` brings: the packages (dcp_pass.models included) and the
dependencies a rank needs to start quietly."""
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_models_are_packaged():
    find_packages = pytest.importorskip("setuptools").find_packages

    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "dcp_pass.models" in find_packages(ROOT, include=include)


def test_numpy_is_a_dependency():
    # without numpy, torch warns "Failed to initialize NumPy" at import, in every rank
    names = [d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
             for d in _pyproject()["project"]["dependencies"]]
    assert {"torch", "triton", "numpy"} <= set(names)


def test_ranks_start_without_numpy_warning():
    code = ("import operator\nfrom dcp_pass.testing import run_ranks\n"
            "assert run_ranks(operator.add, 2, timeout=120) == [2, 3]\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Failed to initialize NumPy" not in done.stderr
