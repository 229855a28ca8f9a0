"""Every environment variable dcp_pass reads, in one place.

Code reads them only through this module (``env.read(name)`` or the functions below), so
this table is the whole list. Values are read when asked for, not cached: tests and
benchmarks set some of them between calls.

==============================  ==========  ==================================================
variable                        default     meaning
==============================  ==========  ==================================================
``DCP_LOGS``                    (unset)     ``info`` (or ``1``) logs what the pass did to each
                                            graph through the "dcp_pass" logger; ``debug``
                                            (``+dcp``, ``2``) adds the details
``DCP_AGREEMENT_TIMEOUT_S``     ``120``     seconds a rank waits at its first compile for the
                                            other ranks' options (dcp_pass/agreement.py)
``DCP_REPLAY``                  (unset)     ``0`` turns the attention op's replay of recorded
                                            launches off (runtime/decode/replay.py)
``DCP_MLA_WIDE``                (unset)     ``0``: the kernel chooser never offers the
                                            two-GEMM ("wide") kernel; ``1``: every call it can
                                            run goes to it (also under Triton's interpreter)
``DCP_MLA_GLUON``               (unset)     ``0``: the chooser never offers the Gluon kernels
``DCP_MLA_TUNED``               (unset)     path of a JSON file whose entries replace the split
                                            kernel's tuned tiles (benchmarks/bench_kernel.py
                                            writes them); read once, at the kernel's import
``DCP_FP8_READ``                (unset)     how the Triton kernels read an fp8 latent cache:
                                            unset, each kernel's faster read on the H200
                                            (split-KV ``fold``, two-GEMM ``dequant``);
                                            ``dequant`` multiplies every value in fp32 first;
                                            ``fold`` applies the per-block scales to scores
                                            and probabilities, the dots in fp16;
                                            ``fold_qdtype`` the same in the queries' dtype;
                                            ``fold_once`` as ``fold``, the split kernel
                                            loading and converting each tile once for both
                                            dots; read at each launch (the op's replay
                                            repeats its first call's launches)
``DCP_FLASHINFER_MLA_BACKEND``  ``auto``    FlashInfer's MLA implementation: ``auto``,
                                            ``fa2`` or ``fa3``
``DCP_FLASHINFER_WORKSPACE_MB`` ``128``     FlashInfer's float workspace per device, MiB
``DCP_TRACE_BROADCAST``         ``1``       ``0``: Dynamo breaks the graph at ``dist.broadcast``
                                            as it does without dcp_pass (dcp_pass/tracing.py)
``DCP_TRACE_ASSERTS``           ``1``       ``0``: Dynamo breaks the graph at a tensor assert
                                            with a run-time message (dcp_pass/tracing.py)
``DCP_TEST_START``              (unset)     ``spawn``: dcp_pass.testing.run_ranks spawns its
                                            ranks everywhere instead of forking them from a
                                            server process on CPU-only machines
``DCP_TEST_FULL``               (unset)     ``1``: the test suite runs its whole matrix (every
                                            form, more ranks, inductor beside aot_eager);
                                            unset, the subset CI runs
==============================  ==========  ==================================================

(The kernel switches are for measuring and for working around a kernel; the option
``attn_backend`` picks the backend, and the registry, runtime/decode/kernels/registry.py,
the kernel.)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

__all__ = [
    "VARIABLES",
    "Variable",
    "agreement_timeout_s",
    "flashinfer_mla_backend",
    "flashinfer_workspace_mb",
    "fp8_read",
    "full_tests",
    "logs_level",
    "mla_gluon",
    "mla_tuned",
    "mla_wide",
    "overridden",
    "ranks_start",
    "read",
    "replay_enabled",
]


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # '' for unset
    meaning: str
    choices: Optional[Tuple[str, ...]] = None  # the values it takes ('' = unset), None: any


VARIABLES = {
    v.name: v
    for v in (
        Variable("DCP_LOGS", "", "log level of the 'dcp_pass' logger: info, debug"),
        Variable("DCP_AGREEMENT_TIMEOUT_S", "120", "seconds a rank waits for the others' options at its first compile"),
        Variable("DCP_REPLAY", "", "0 turns the attention op's launch replay off"),
        Variable("DCP_MLA_WIDE", "", "0: never offer the two-GEMM kernel; 1: send every call it can run to it"),
        Variable("DCP_MLA_GLUON", "", "0: never offer the Gluon kernels"),
        Variable("DCP_MLA_TUNED", "", "JSON file replacing the split kernel's tuned tiles"),
        Variable(
            "DCP_FP8_READ",
            "",
            "how the Triton kernels read an fp8 latent: unset (each kernel's faster read), "
            "dequant, fold, fold_qdtype or fold_once",
            ("", "dequant", "fold", "fold_qdtype", "fold_once"),
        ),
        Variable("DCP_FLASHINFER_MLA_BACKEND", "auto", "FlashInfer's MLA implementation", ("auto", "fa2", "fa3")),
        Variable("DCP_FLASHINFER_WORKSPACE_MB", "128", "FlashInfer's float workspace per device, MiB"),
        Variable(
            "DCP_TRACE_BROADCAST", "1", "0: Dynamo breaks graphs at dist.broadcast as without dcp_pass", ("0", "1")
        ),
        Variable(
            "DCP_TRACE_ASSERTS", "1", "0: Dynamo breaks graphs at tensor asserts with run-time messages", ("0", "1")
        ),
        Variable("DCP_TEST_START", "", "spawn: run_ranks spawns its ranks everywhere"),
        Variable("DCP_TEST_FULL", "", "1: the tests run their whole matrix", ("", "0", "1")),
    )
}


@contextlib.contextmanager
def overridden(name: str, value: Optional[str]) -> Iterator[None]:
    """`name` set to `value` (None: unset) inside (benchmarks and tests that time or check one
    setting beside another); the previous value, or its absence, restored after."""
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def read(name: str) -> str:
    """The value of `name` (stripped; its default when unset or empty). An unknown name is a
    programming error, and a value outside the variable's choices a user's: both raise
    ValueError saying what is valid."""
    var = VARIABLES.get(name)
    if var is None:
        raise ValueError(f"{name!r} is not one of dcp_pass's environment variables ({', '.join(VARIABLES)})")
    value = os.environ.get(name, "").strip() or var.default
    if var.choices is not None and value not in var.choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, var.choices))}, got {value!r}")
    return value


def logs_level() -> str:
    """'' (off), or the DCP_LOGS level in lower case."""
    return read("DCP_LOGS").lower()


def agreement_timeout_s() -> float:
    return float(read("DCP_AGREEMENT_TIMEOUT_S"))


def replay_enabled() -> bool:
    return read("DCP_REPLAY") != "0"


def mla_wide() -> str:
    """DCP_MLA_WIDE: '0' (off), '1' (forced) or '' (the chooser decides)."""
    return read("DCP_MLA_WIDE")


def mla_gluon() -> str:
    """DCP_MLA_GLUON: '0' (off) or '' (the chooser decides)."""
    return read("DCP_MLA_GLUON")


def mla_tuned() -> str:
    """DCP_MLA_TUNED: a path, or ''."""
    return read("DCP_MLA_TUNED")


def fp8_read() -> str:
    """DCP_FP8_READ: '' (unset: each kernel's own default), 'dequant', 'fold', 'fold_qdtype' or 'fold_once'."""
    return read("DCP_FP8_READ")


def flashinfer_mla_backend() -> str:
    return read("DCP_FLASHINFER_MLA_BACKEND")


def flashinfer_workspace_mb() -> int:
    return int(read("DCP_FLASHINFER_WORKSPACE_MB"))


def ranks_start() -> str:
    """DCP_TEST_START: 'spawn', or ''."""
    return read("DCP_TEST_START")


def full_tests() -> bool:
    """DCP_TEST_FULL=1: the tests run their whole matrix, not CI's subset."""
    return read("DCP_TEST_FULL") == "1"
