"""The example models are a packaged module (dcp_pass.models), importable from anywhere;
their old paths (examples.*) still import, as the very same module objects."""
import importlib
import os
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("deepseek_mla", "hybrid_linear", "generate")


@pytest.mark.parametrize("name", MODULES)
def test_old_path_is_the_new_module(name):
    new = importlib.import_module(f"dcp_pass.models.{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module(f"examples.{name}")
    assert old is new
    assert sys.modules[f"examples.{name}"] is new


def test_old_path_keeps_private_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from examples.deepseek_mla import _build, build_model
        from examples.hybrid_linear import build_hybrid
    from dcp_pass.models import deepseek_mla, hybrid_linear

    assert (_build, build_model, build_hybrid) == (deepseek_mla._build, deepseek_mla.build_model,
                                                    hybrid_linear.build_hybrid)


def _run_elsewhere(tmp_path, *args):
    # this checkout's dcp_pass, imported from a directory that holds neither it nor examples/
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_models_import_from_another_directory(tmp_path):
    code = ("import dcp_pass.models.deepseek_mla as m, dcp_pass.models.hybrid_linear, dcp_pass.models.generate; "
            "import os; print(os.path.dirname(m.__file__))")
    done = _run_elsewhere(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert os.path.samefile(done.stdout.strip(), os.path.join(ROOT, "dcp_pass", "models"))


def test_demo_help_from_another_directory(tmp_path):
    done = _run_elsewhere(tmp_path, "-m", "dcp_pass.demo", "--help")
    assert done.returncode == 0, done.stderr
    assert "--context" in done.stdout
