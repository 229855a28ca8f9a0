"""The example models are a packaged module (dcp_pass.models), importable from anywhere."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_elsewhere(tmp_path, *args):
    # this checkout's dcp_pass, imported from a directory that does not hold it
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
