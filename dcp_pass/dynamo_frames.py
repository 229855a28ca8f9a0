"""What Dynamo is doing in this thread: its eval-frame callback, the compiler of the frame it
traces, the backends it knows. These read Dynamo internals; each says so where it does."""

from __future__ import annotations

from typing import Any

import torch


def eval_frame_callback() -> Any:
    """Dynamo's current eval-frame callback (None, False or True when it compiles nothing here)."""
    get = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return get() if get is not None else None


def tracing_compiler_fn() -> Any:
    """The compiler function of the frame Dynamo is tracing now; raises if none (or internals moved)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx().output.compiler_fn


def registered_backends() -> list[str]:
    """Every backend name Dynamo knows, debug ones included."""
    return torch._dynamo.list_backends(exclude_tags=())
