"""Two things Dynamo breaks graphs on that models of the field do inside attention, traced instead.

DeepSeek-V3.2's sparse attention (its lightning indexer) calls `dist.broadcast` on the
top-k indices and checks them with `assert torch.all(...), f"..."` between the score
contraction and the softmax. Plain Dynamo breaks the graph at both, so the softmax lands
in a graph of its own that receives the scores as an input, and no pass can see the
attention whole. Installed when the `dcp` backend module is imported (before the first
trace of a model compiled with it), these make Dynamo trace both:

* `dist.broadcast(t, src, group)` as the functional collective
  `t.copy_(broadcast(t, src, group))`: the graph node a functional collective is, with
  the in-place semantics of the call (Dynamo already traces all_reduce, all_gather and
  reduce_scatter this way, through `traceable_collective_remaps`; broadcast is missing
  from that table in torch 2.11-2.13).
* `assert cond, message` on a tensor whose message is built at run time (an f-string)
  as `torch._assert_async(cond, constant message)`, as Dynamo already does for constant
  messages. A failing check then raises RuntimeError (with the source line) instead of
  the model's AssertionError; the f-string is not evaluated.

Both change how Dynamo traces for the whole process, not only for `backend="dcp"`: the
traced graphs compute what the model does. `DCP_TRACE_BROADCAST=0` / `DCP_TRACE_ASSERTS=0`
leave Dynamo as it is. Both use Dynamo internals (the other files that do are
rewrites/fx_util.py and dynamo_frames.py); if they moved, nothing is installed and a debug line says so.
"""

from __future__ import annotations

import operator
import os

from dcp_pass import env
from dcp_pass.report import log

_INSTALLED: dict[str, bool] = {}


def _traced_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """What Dynamo traces for `dist.broadcast`: the functional broadcast copied back in place."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if not funcol._are_we_tracing():
        raise AssertionError("dcp_pass: the traced broadcast runs only while Dynamo traces")
    if async_op:
        raise AssertionError("dcp_pass: an async broadcast cannot be traced as a functional collective")
    if group is None:
        group = dist.group.WORLD
    if group_src is None:  # the functional op takes the root's rank in the group; dist.broadcast a global rank
        group_src = src if group is dist.group.WORLD else dist.get_group_rank(group, src)
    tensor.copy_(funcol.broadcast(tensor, group_src, group))


def install_traced_broadcast() -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    import torch.distributed._functional_collectives as funcol

    remaps = getattr(funcol, "traceable_collective_remaps", None)
    if remaps is None or not hasattr(funcol, "_are_we_tracing"):
        return False
    if dist.broadcast not in remaps:
        # Dynamo finds the wrapper by its name in this module (the guard source it builds)
        _traced_broadcast.__name__ = "_dcp_traced_broadcast"
        funcol._dcp_traced_broadcast = _traced_broadcast  # type: ignore[attr-defined]
        remaps[dist.broadcast] = _traced_broadcast
    return True


def install_traced_asserts() -> bool:
    import torch._dynamo.symbolic_convert as sc
    from torch._dynamo.variables import VariableTracker

    detect = getattr(sc, "_detect_and_normalize_assert_statement", None)
    if detect is None:
        return False
    if getattr(detect, "_dcp_any_message", False):
        return True

    def detect_any_message(self, truth_fn, push):
        if detect(self, truth_fn, push):
            return True
        if truth_fn is not operator.truth or push:
            return False
        insts, ip = self.instructions, self.instruction_pointer
        if ip >= len(insts) or insts[ip].opname != "LOAD_ASSERTION_ERROR":
            return False
        for inst in insts[ip + 1 :]:  # up to the raise, with no jump: the message's own code
            if inst.opname == "RAISE_VARARGS":
                where = f"{os.path.basename(self.f_code.co_filename)}:{self.lineno}"
                self.push(VariableTracker.build(self, f"assertion failed at {where} (traced by dcp_pass)"))
                return True
            if "JUMP" in inst.opname or inst.opname.startswith("RETURN"):
                return False
        return False

    detect_any_message._dcp_any_message = True  # type: ignore[attr-defined]  # marks the patch as ours
    sc._detect_and_normalize_assert_statement = detect_any_message
    return True


def install() -> dict[str, bool]:
    """Install both (once), unless switched off by their environment variables."""
    if _INSTALLED:
        return _INSTALLED
    for name, var, fn in (
        ("broadcast", "DCP_TRACE_BROADCAST", install_traced_broadcast),
        ("asserts", "DCP_TRACE_ASSERTS", install_traced_asserts),
    ):
        if env.read(var) == "0":
            _INSTALLED[name] = False
            continue
        try:
            _INSTALLED[name] = fn()
        except Exception as why:  # noqa: BLE001 - Dynamo internals moved: trace as Dynamo does
            log.debug("dcp_pass: traced %s not installed: %s", name, why)
            _INSTALLED[name] = False
    return _INSTALLED
