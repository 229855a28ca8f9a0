"""Every ```python block of README.md and docs/*.md (not docs/archive/), and every
examples/*.py, runs as written.

Each block runs on its own, as a script under `torchrun --nproc-per-node 2` would: two
gloo CPU ranks (dcp_pass.testing.run_ranks), torch.distributed initialised, RANK /
WORLD_SIZE / LOCAL_RANK set, the repository root as working directory, `__name__` set
to "__main__", nothing shared with the file's other blocks. A block right after a line
`<!-- not run: <reason> -->` is skipped with that reason; one right after
`<!-- plain process: <reason> -->` runs in one fresh Python process without
torch.distributed (code that makes its own process group, such as graph_stages). A failing
block is reported with its file, its first line and each failed rank's traceback (whose
line numbers are the markdown file's). An example file is one block; one whose docstring
says "torch.distributed is not set up" runs in a plain process.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

from dcp_pass.testing import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 2
TIMEOUT_S = 300

_FENCE = re.compile(r"^(\s*)```\s*python\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
_PLAIN = re.compile(r"^\s*<!--\s*plain process:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    source: str
    skip: Optional[str]  # the reason of a preceding `<!-- not run: ... -->`, else None
    plain: bool = False  # after `<!-- plain process: ... -->`: one process, no torch.distributed

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks(text: str, path: str) -> list[Block]:
    """The ```python blocks of a markdown text, dedented by their fence's indent."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent = fence.group(1)
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        blocks.append(Block(path, i + 2, "\n".join(body) + "\n", marker.group(1) if marker else None,
                            _PLAIN.match(before) is not None))
        i = end + 1
    return blocks


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [f for f in files if os.path.exists(f)]


def all_blocks() -> list[Block]:
    out = []
    for f in doc_files():
        with open(f) as fh:
            out += python_blocks(fh.read(), os.path.relpath(f, ROOT))
    return out


def example_blocks() -> list[Block]:
    """examples/*.py, each as one block."""
    out = []
    for f in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py"))):
        with open(f) as fh:
            source = fh.read()
        out.append(Block(os.path.relpath(f, ROOT), 1, source, None, "torch.distributed is not set up" in source))
    return out


def _run_block(rank: int, world: int, source: str, path: str, line: int, root: str) -> None:
    os.chdir(root)
    # padded so that tracebacks give the markdown file's line numbers
    code = compile("\n" * (line - 1) + source, os.path.join(root, path), "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


def run_block(block: Block, root: str = ROOT, ranks: int = RANKS, timeout: float = TIMEOUT_S) -> None:
    """Run one block on `ranks` fresh ranks; AssertionError naming the block when any rank fails."""
    try:
        run_ranks(_run_block, ranks, block.source, block.path, block.line, root, timeout=timeout)
    except (RuntimeError, TimeoutError) as failed:
        raise AssertionError(f"python block at {block.where} failed on {ranks} gloo ranks:\n{failed}") from None


def run_plain(block: Block, root: str = ROOT, timeout: float = TIMEOUT_S) -> None:
    """Run one block as `python -c` in the repository root; AssertionError with its output when it fails."""
    code = "\n" * (block.line - 1) + block.source  # tracebacks give the markdown file's lines
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EXPECTTEST_ACCEPT")}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"python block at {block.where} failed in a plain process:\n{done.stdout}\n{done.stderr}")


# ----------------------------------------------------------------------------- the docs' blocks

BLOCKS = all_blocks() + example_blocks()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_doc_block_runs(block):
    if block.skip is not None:
        pytest.skip(f"{block.where}: not run: {block.skip}")
    if "transformers" in block.source:  # the optional extra 'hf'
        pytest.importorskip("transformers")
    if block.plain:
        run_plain(block)
    else:
        run_block(block)


# ----------------------------------------------------------------------------- the harness itself


SAMPLE = """\
# Title

```python
import os
x = 1
```

<!-- not run: needs a GPU -->

```python
raise SystemExit("never")
```

<!-- plain process: makes its own process group -->

```python
import torch.distributed as dist
assert not dist.is_initialized()
```

- a list item:

  ```python
  y = 2
  ```
"""


def test_blocks_are_found_with_lines_and_skips():
    blocks = python_blocks(SAMPLE, "X.md")
    assert [(b.line, b.source, b.skip, b.plain) for b in blocks] == [
        (4, "import os\nx = 1\n", None, False), (11, 'raise SystemExit("never")\n', "needs a GPU", False),
        (17, "import torch.distributed as dist\nassert not dist.is_initialized()\n", None, True),
        (24, "y = 2\n", None, False)]
    run_plain(blocks[2], timeout=120)
    assert all_blocks() and {b.path for b in all_blocks()} <= {os.path.relpath(f, ROOT) for f in doc_files()}
    assert not any(b.path.startswith(os.path.join("docs", "archive")) for b in all_blocks())
    examples = {b.path: b.plain for b in example_blocks()}
    assert examples == {os.path.join("examples", name): plain for name, plain in
                        [("hf_generate.py", False), ("pin_graphs.py", True), ("reference_model.py", False)]}


def test_a_failing_block_names_file_line_and_traceback():
    source = ("import os, torch.distributed as dist\n"
              "assert dist.get_world_size() == int(os.environ['WORLD_SIZE']) == 2 and os.getcwd() == ROOT\n"
              "if dist.get_rank() == 1:\n"
              "    raise ValueError('boom on rank ' + os.environ['RANK'])\n")
    block = Block("docs/x.md", 40, f"ROOT = {ROOT!r}\n" + source, None)
    with pytest.raises(AssertionError) as failed:
        run_block(block, timeout=120)
    text = str(failed.value)
    assert "python block at docs/x.md:40 failed" in text
    assert "ValueError: boom on rank 1" in text
    assert f'{os.path.join(ROOT, "docs", "x.md")}", line 44' in text  # the markdown file's line
