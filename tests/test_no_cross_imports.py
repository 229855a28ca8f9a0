"""No test file imports another test file: shared helpers live in tests/kit/."""
import ast
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _imported_modules(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_no_test_file_imports_another():
    files = [f for f in os.listdir(HERE) if f.endswith(".py")]
    assert "test_graph_diff.py" in files
    found = [f"{name} imports {module}" for name in sorted(files)
             for module in _imported_modules(os.path.join(HERE, name))
             if module.split(".")[0].startswith("test_")]
    assert found == []
