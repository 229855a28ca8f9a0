"""CPU checks of Triton kernels under Triton's interpreter, run in one worker process.

TRITON_INTERPRET=1 must be set before triton is imported, and setting it inside a shared
pytest process would turn every other module's kernels into interpreted ones. So a test
module's ``check_*`` functions run in a subprocess (the module run as a script with
``--worker``) and pytest reports one test per check from the worker's results.

In a test module::

    CPU_CHECKS = interpreter.check_names(globals())

    @pytest.fixture(scope="module")
    def cpu_results():
        return interpreter.run_worker(__file__, ROOT)

    if __name__ == "__main__" and "--worker" in sys.argv:
        interpreter.worker_main(globals(), ROOT)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

MARKER = "@@RESULTS@@"


def check_names(namespace: dict) -> list[str]:
    """The module's checks: every ``check_*`` function except the shared ``check_close``."""
    return sorted(n for n in namespace if n.startswith("check_") and n != "check_close" and callable(namespace[n]))


def worker_main(namespace: dict, root: str) -> None:
    """Run every check in ``namespace`` and print their results on one marked line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    sys.path.insert(0, root)
    results = {}
    for name in check_names(namespace):
        try:
            namespace[name]()
            results[name] = {"ok": True, "msg": ""}
        except BaseException:  # noqa: BLE001 - reported back to pytest
            results[name] = {"ok": False, "msg": traceback.format_exc()}
    print(MARKER + json.dumps(results))


def run_worker(test_file: str, root: str, unset: tuple[str, ...] = ("DCP_MLA_WIDE",), timeout: float = 600) -> dict:
    """Run ``test_file --worker`` under the interpreter; ``{check: {"ok", "msg"}}``.

    Variables in ``unset`` are removed so that a developer's environment (e.g. a forced
    kernel path) does not change what the checks test.
    """
    import pytest

    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in unset:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(test_file), "--worker"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)), None)
    if line is None:
        pytest.fail(f"interpreter worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len(MARKER) :])
