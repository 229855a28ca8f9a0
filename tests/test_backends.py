"""The backend tables (dcp_pass/runtime/decode/backends.py): every chooser reads the same names."""
import importlib.util

import pytest
import torch

from dcp_pass import options
from dcp_pass.backend import check_attn_backend
from dcp_pass.options import DcpOptionError
from dcp_pass.runtime.decode import backends, comm
from dcp_pass.runtime.decode.backends import (
    ATTENTION_BACKENDS,
    COMM_BACKENDS,
    AttentionBackendUnavailable,
    attention_lse_base,
    resolve_attention_backend,
)
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kernels.reference import attention_reference


def test_option_names_come_from_the_tables():
    assert options.COMM_BACKENDS == tuple(COMM_BACKENDS) == ("a2a", "ag_rs", "fi_a2a")
    assert options.ATTN_BACKENDS == ("auto", *ATTENTION_BACKENDS) == ("auto", "triton", "flashinfer", "torch")
    assert comm.COMM_BACKENDS is COMM_BACKENDS


def test_comm_table_holds_the_exchanges_the_graph_calls():
    assert COMM_BACKENDS["a2a"].exchange is comm.exchange_a2a
    assert COMM_BACKENDS["ag_rs"].exchange is comm.exchange_ag_rs
    assert COMM_BACKENDS["fi_a2a"].exchange is comm.exchange_fi_a2a
    assert {n: b.replicated_method for n, b in COMM_BACKENDS.items()} == {"a2a": "a2a", "ag_rs": "ag_rs",
                                                                         "fi_a2a": "a2a"}


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("requested, device, dtype, expected", [
    ("auto", CUDA, torch.bfloat16, "triton"),
    ("auto", CUDA, torch.float16, "triton"),
    ("auto", CUDA, torch.float32, "torch"),  # fp32 caches: the checking mode
    ("auto", CPU, torch.bfloat16, "torch"),
    (None, CUDA, torch.float32, "triton"),  # runtime features: the kernels' own dispatch
    (None, CPU, torch.float32, "torch"),
    ("torch", CUDA, torch.bfloat16, "torch"),
    ("triton", CUDA, torch.float32, "triton"),
])
def test_attention_routing(requested, device, dtype, expected):
    assert resolve_attention_backend(requested, device, dtype).name == expected


def test_unavailable_attention_backend():
    with pytest.raises(AttentionBackendUnavailable, match="needs CUDA"):
        resolve_attention_backend("triton", CPU, torch.float32)
    if importlib.util.find_spec("flashinfer") is None or not torch.cuda.is_available():
        with pytest.raises(AttentionBackendUnavailable, match="flashinfer"):
            resolve_attention_backend("flashinfer", CUDA, torch.bfloat16)
    # the compiled op's non-strict resolution falls back to the reference (refused at compile)
    assert resolve_attention_backend("triton", CPU, torch.float32, strict=False).name == "torch"
    assert resolve_attention_backend("flashinfer", CPU, torch.float32, strict=False).name == "torch"
    with pytest.raises(DcpOptionError, match="needs CUDA tensors, the model is on cpu; use 'auto' or 'torch'"):
        check_attn_backend("triton", CPU)
    with pytest.raises(DcpOptionError, match="'flashinfer' cannot run"):
        check_attn_backend("flashinfer", CPU)


def test_lse_bases():
    assert attention_lse_base("auto") == "e"
    assert attention_lse_base("torch") == "e"
    assert attention_lse_base("flashinfer") == "2"


def test_torch_backend_runs_the_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 8, generator=g)
    kv = torch.randn(2, 5, 8, generator=g)
    call = AttentionCall(q, None, kv, None, 6, 0.3)
    out, lse = backends.attend(call, "torch")
    ref_out, ref_lse = attention_reference(call)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert backends.ATTENTION_BACKENDS["torch"].kernels == ("torch",)

