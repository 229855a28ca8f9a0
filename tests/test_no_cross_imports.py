"""Import rules, read from the source (every import statement, function-local ones included):

* no test file imports another test file: shared helpers live in tests/kit/;
* the runtime (dcp_pass/runtime/) never imports the rewrites, the run-time state, the compile
  entry (backend) or the deferred-allocation entry: the rewritten graphs call into the
  runtime, never the other way round;
* the run-time state (dcp_pass/state/: the striped-cache and weight stores, their guards, the
  per-call feeder) never imports the rewrites or those entries: it lives with the model it
  serves, whatever compiled it;
* the rewrites (dcp_pass/rewrites/) are FX code: only the modules that hand run-time state to
  the compiled graph (the pipeline, which makes and installs the shards, and the query
  replication, whose extra inputs are weight-store lookups) and the cache kinds (each names
  its run-time half) import dcp_pass.state, and no module there keeps a store of its own;
* the recognisers (dcp_pass/rewrites/recognisers/) read graphs only: they import no run-time
  state (the runtime, dcp_pass/state/, the rewrites that emit references to it) and no
  compile entry.
"""
import ast
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE = os.path.join(ROOT, "dcp_pass")


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def imported_modules(source, module, is_package=False):
    """Every module `source` (the text of module `module`) imports, as absolute dotted names:
    `import a.b`, `from a import b` (both `a` and `a.b`, as b may be a module), relative
    imports resolved, anywhere in the file, and string arguments of import_module/__import__."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.args[0].value


def _files(folder):
    for dirpath, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _violations(folder, forbidden):
    """(module, what it imports) for every import under `folder` of a forbidden module or of
    something inside one."""
    found = set()
    for path in _files(folder):
        module = _module_name(path)
        with open(path) as f:
            source = f.read()
        for name in imported_modules(source, module, path.endswith("__init__.py")):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.add((module, name))
    return found


def test_no_test_file_imports_another():
    files = [f for f in os.listdir(HERE) if f.endswith(".py")]
    assert "test_graph_diff.py" in files
    found = [f"{name} imports {module}" for name in sorted(files)
             for module in imported_modules(open(os.path.join(HERE, name)).read(), name[:-3])
             if module.split(".")[0].startswith("test_")]
    assert found == []


RUNTIME_MAY_NOT_IMPORT = ("dcp_pass.rewrites", "dcp_pass.state", "dcp_pass.backend", "dcp_pass.deferred")
STATE_MAY_NOT_IMPORT = ("dcp_pass.rewrites", "dcp_pass.backend", "dcp_pass.deferred")


def test_runtime_never_imports_the_rewrites_the_state_or_the_compile_entry():
    assert sum(1 for _ in _files(os.path.join(PACKAGE, "runtime"))) > 20
    assert _violations(os.path.join(PACKAGE, "runtime"), RUNTIME_MAY_NOT_IMPORT) == set()


def test_state_never_imports_the_rewrites_or_the_compile_entry():
    assert sum(1 for _ in _files(os.path.join(PACKAGE, "state"))) >= 6
    assert _violations(os.path.join(PACKAGE, "state"), STATE_MAY_NOT_IMPORT) == set()


# the rewrites that hand run-time state to the compiled graph: the pass pipeline (it makes each
# buffer's shard and installs it), the query replication (its extra inputs look the other
# ranks' weight shards up per call), and each cache kind (its record names its shard kind; the
# ring-then-entries kind also reads the ring size the store keeps per buffer)
REWRITES_THAT_IMPORT_STATE = {"dcp_pass.rewrites.apply", "dcp_pass.rewrites.q_replicate",
                              "dcp_pass.rewrites.cache_kinds.flat", "dcp_pass.rewrites.cache_kinds.paged",
                              "dcp_pass.rewrites.cache_kinds.static_cache", "dcp_pass.rewrites.cache_kinds.ring_entries"}


def test_only_the_rewrites_that_hand_state_to_the_graph_import_it():
    importing = {module for module, _ in _violations(os.path.join(PACKAGE, "rewrites"), ("dcp_pass.state",))}
    assert importing == REWRITES_THAT_IMPORT_STATE


def test_the_rewrites_keep_no_store_of_their_own():
    """A weak-keyed table or a tensor subclass in the rewrites is run-time state in the wrong room."""
    found = []
    for path in _files(os.path.join(PACKAGE, "rewrites")):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in ("WeakIdKeyDictionary", "WeakKeyDictionary"):
                found.append((_module_name(path), node.id))
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) in ("torch.Tensor", "Tensor") for b in node.bases):
                found.append((_module_name(path), node.name))
    assert found == []


# run-time state, and the compile entries and rewrites that hold or emit it
RECOGNISERS_MAY_NOT_IMPORT = ("dcp_pass.runtime", "dcp_pass.state", "dcp_pass.rewrites.q_replicate",
                              "dcp_pass.rewrites.apply", "dcp_pass.backend", "dcp_pass.deferred")


def test_recognisers_import_no_run_time_state():
    folder = os.path.join(PACKAGE, "rewrites", "recognisers")
    assert sum(1 for _ in _files(folder)) >= 5
    assert _violations(folder, RECOGNISERS_MAY_NOT_IMPORT) == set()


@pytest.mark.parametrize("source, module, expected", [
    ("import dcp_pass.rewrites.apply\n", "dcp_pass.runtime.decode.x", "dcp_pass.rewrites.apply"),
    ("def f():\n    from dcp_pass.rewrites import apply\n", "dcp_pass.runtime.decode.x", "dcp_pass.rewrites.apply"),
    ("from dcp_pass import backend\n", "dcp_pass.runtime.x", "dcp_pass.backend"),
    ("from ...rewrites import axes\n", "dcp_pass.runtime.decode.x", "dcp_pass.rewrites.axes"),
    ("import importlib\nimportlib.import_module('dcp_pass.deferred')\n", "dcp_pass.runtime.x", "dcp_pass.deferred"),
])
def test_every_form_of_import_is_seen(source, module, expected):
    assert expected in set(imported_modules(source, module))
