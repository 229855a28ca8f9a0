"""The complex-product rewrite (rewrites/complex_product.py): the reference rotary in real arithmetic.

Each case captures a small module through Dynamo, rewrites the graph, and compares the
compiled module with eager on fresh inputs (fp32 / fp64, NaN included). Graph code is
pinned; inductor's code for the rewritten graph must hold no complex fallback op.
"""
from __future__ import annotations

import re

from kit.graphs import PinCase
import pytest
import torch
import torch.fx as fx
from torch import nn

from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.rewrites.complex_product import complex_products_as_real
from dcp_pass.runtime.decode.rotary import complex_mul_real
from dcp_pass.testing.graphs import readable_code as _normalize


def freqs(rope: int, max_seq: int, dtype=torch.complex64) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv)
    return torch.polar(torch.ones_like(angles), angles).to(dtype)


def rotate(x: torch.Tensor, f: torch.Tensor, real=torch.float32) -> torch.Tensor:
    """The reference code's apply_rotary_emb: x [b, s, h, d], f [s, d // 2] complex
    (computed in `real`, f's real dtype: `.float()` in the reference)."""
    xc = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f.view(1, xc.size(1), 1, xc.size(-1))).flatten(3).to(x.dtype)


class IntPositionRotary(nn.Module):
    """Rotary at an int step position (`freqs_cis[start:start + s]`), two products sharing it."""

    def __init__(self, rope=8, max_seq=64, dtype=torch.complex64):
        super().__init__()
        self.register_buffer("freqs_cis", freqs(rope, max_seq, dtype), persistent=False)
        self.real = dtype.to_real()

    def forward(self, q, k, start_pos: int):
        f = self.freqs_cis[start_pos:start_pos + q.size(1)]
        return rotate(q, f, self.real) * 2, rotate(k, f, self.real)


class TensorPositionRotary(nn.Module):
    """Rotary at device positions (`freqs_cis[positions]`), operands in the other order and
    the complex operand reached through unsqueeze with a negative dim."""

    def __init__(self, rope=8, max_seq=64):
        super().__init__()
        self.register_buffer("freqs_cis", freqs(rope, max_seq), persistent=False)

    def forward(self, x, positions):
        f = self.freqs_cis[positions].unsqueeze(-2)  # [s, 1, d/2]
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(f * xc).flatten(-2)


class InverseRotary(nn.Module):
    """Rotary back by the conjugate (`freqs_cis.conj()`, DeepSeek-V4's output rotation): the
    complex operand is a conjugate view, whose `view_as_real` fails at run time."""

    def __init__(self, rope=8, max_seq=64):
        super().__init__()
        self.register_buffer("freqs_cis", freqs(rope, max_seq), persistent=False)

    def forward(self, x, start_pos: int):
        f = self.freqs_cis[start_pos:start_pos + x.size(1)].conj()
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * f.view(1, xc.size(1), 1, xc.size(-1))).flatten(3)


class Captured:
    """A Dynamo backend that rewrites each graph, keeps it, and runs it with `inner`."""

    def __init__(self, inner=None):
        self.inner, self.graphs, self.counts, self.examples = inner, [], [], []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.examples.append(list(example_inputs))
        self.counts.append(complex_products_as_real(gm.graph))
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        return self.inner(gm, example_inputs) if self.inner else gm.forward


def complex_ops(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.view_as_complex]


class ComplexProductTest(PinCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_int_position_rotary_graph(self):
        be = Captured()
        m = IntPositionRotary()
        compiled = torch.compile(m, backend=be, dynamic=True)
        q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 1, 8)
        compiled(q, k, 3)
        self.assertEqual(be.counts, [2])
        gm = be.graphs[0]
        self.assertEqual(complex_ops(gm), [])
        code = re.sub(r"\bs\d+\b", "s_", _normalize(gm.code))  # symbol numbers vary by torch version
        body = "\n".join(line.strip() for line in code.splitlines() if "=" in line and "def forward" not in line)
        self.assertExpectedInline(body[body.index("l_self_buffers_freqs_cis__real ="):], """\
l_self_buffers_freqs_cis__real = torch.view_as_real(freqs_cis)
f_real = l_self_buffers_freqs_cis__real[slice(start_pos, add, None)]
to = q.to(torch.float32)
reshape = to.reshape(s_, 1, s_, -1, 2)
floordiv = s_ // 2
view_real = f_real.view(1, 1, 1, floordiv, 2)
mul_as_real = dcp_pass_runtime_decode_rotary_complex_mul_real(reshape, view_real)
flatten = mul_as_real.flatten(3)
to_1 = flatten.to(torch.float32)
mul_1 = to_1 * 2
to_2 = k.to(torch.float32)
reshape_1 = to_2.reshape(s_, 1, 1, -1, 2)
view_1_real = f_real.view(1, 1, 1, floordiv, 2)
mul_2_as_real = dcp_pass_runtime_decode_rotary_complex_mul_real(reshape_1, view_1_real)
flatten_1 = mul_2_as_real.flatten(3)
to_3 = flatten_1.to(torch.float32)""")

    def _check_equal(self, module, make_inputs, dtype, inner=None, steps=(3, 7, 60)):
        be = Captured(inner)
        compiled = torch.compile(module, backend=be, dynamic=True)
        for step in steps:
            inputs = make_inputs(step, dtype)
            got, want = compiled(*inputs), module(*inputs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                self.assertEqual(g.dtype, w.dtype)
                torch.testing.assert_close(g, w, rtol=0, atol=4 * torch.finfo(w.dtype).eps, equal_nan=True)
                self.assertTrue(torch.equal(g.isnan(), w.isnan()))
        self.assertTrue(all(n > 0 for n in be.counts), be.counts)
        return be

    @staticmethod
    def _int_inputs(step, dtype):
        q, k = torch.randn(3, 1, 4, 8, dtype=dtype), torch.randn(3, 1, 1, 8, dtype=dtype)
        q[1, 0, 2, 5] = float("nan")  # NaN in, NaN out: in its own pair only
        return q, k, step

    def test_int_position_equals_eager_fp32(self):
        self._check_equal(IntPositionRotary(), self._int_inputs, torch.float32)

    def test_int_position_equals_eager_fp64(self):
        self._check_equal(IntPositionRotary(dtype=torch.complex128), self._int_inputs, torch.float64)

    def test_conjugate_operand_equals_eager(self):
        """real(conj(z)) is (re, -im) of real(z): the product is rewritten and runs (a view_as_real of
        the conjugate view would fail at run time)."""
        be = self._check_equal(InverseRotary(), lambda step, dtype: (torch.randn(2, 1, 4, 8, dtype=dtype), step),
                               torch.float32)
        self.assertEqual(be.counts, [1])
        self.assertEqual(complex_ops(be.graphs[-1]), [])

    def test_int_position_under_inductor(self):
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.utils import run_and_get_code

        be = Captured(compile_fx)
        m = IntPositionRotary()
        compiled = torch.compile(m, backend=be, dynamic=True)
        q, k, step = self._int_inputs(5, torch.float32)
        (got, _), code = run_and_get_code(compiled, q, k, step)
        torch.testing.assert_close(got, m(q, k, step)[0], rtol=0, atol=1e-6, equal_nan=True)
        text = "\n".join(code)
        # one view_as_real of the freqs buffer, no complex multiply, view or index
        self.assertEqual(text.count("torch.ops.aten.view_as_real.default("), 1)
        for op in ("view_as_complex", "aten.mul.Tensor", "aten.reshape.default", "aten.slice.Tensor"):
            self.assertNotIn(op, text)

    def test_tensor_positions_and_operand_order(self):
        def inputs(step, dtype):
            return torch.randn(2, 4, 8, dtype=dtype), torch.tensor([step, step + 1])

        be = self._check_equal(TensorPositionRotary(), inputs, torch.float32)
        self.assertEqual(complex_ops(be.graphs[0]), [])

    def test_aot_traces_the_rewritten_graph_symbolically(self):
        """aot / inductor retrace the rewritten graph with SymInts (dynamic=True, int position)."""
        from torch._dynamo.backends.debugging import aot_eager

        be = self._check_equal(IntPositionRotary(), self._int_inputs, torch.float32, inner=aot_eager)
        self.assertEqual(len(be.graphs), 1)  # one symbolic graph served every step

    def test_mismatched_dtypes_stay_complex(self):
        """A float32 x against complex128 freqs promotes: left as it is (what the product computes)."""

        class Promoting(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("freqs_cis", freqs(8, 16, torch.complex128), persistent=False)

            def forward(self, x):
                xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
                return torch.view_as_real(xc * self.freqs_cis[:x.size(0)])

        be = Captured()
        m = Promoting()
        x = torch.randn(4, 8)
        torch.testing.assert_close(torch.compile(m, backend=be)(x), m(x))
        self.assertEqual(be.counts, [0])

    def test_write_between_product_and_view_stays_complex(self):
        """x written in place between the multiply and view_as_real: the real form would
        read the new x, so the product is left as it is."""

        class WriteAfter(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("freqs_cis", freqs(8, 16), persistent=False)

            def forward(self, x):
                x = x.clone()
                prod = torch.view_as_complex(x) * self.freqs_cis[:x.size(0)]
                x.mul_(3)
                return torch.view_as_real(prod), x

        be = Captured()
        m = WriteAfter()
        x = torch.randn(4, 4, 2)
        for got, want in zip(torch.compile(m, backend=be)(x), m(x)):
            torch.testing.assert_close(got, want)
        self.assertEqual(be.counts, [0])

    def test_ellipsis_index_keeps_its_complex_view(self):
        """`freqs[..., :k]` would reach the real dim on the real view: the indexed tensor is
        viewed as real itself (still no complex multiply)."""

        class EllipsisSlice(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("freqs_cis", freqs(16, 8), persistent=False)

            def forward(self, x):
                xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
                return torch.view_as_real(xc * self.freqs_cis[..., :4])

        be = self._check_equal(EllipsisSlice(), lambda step, dtype: (torch.randn(8, 8, dtype=dtype),),
                               torch.float32, steps=(0,))
        code = be.graphs[0].code
        self.assertRegex(code, r"torch.view_as_real\(getitem_\d+\)")
        self.assertNotIn("view_as_real(l_self_buffers_freqs_cis_)", code)

    def test_inference_mode_block_stays_one_block(self):
        """The buffer's real view goes inside a decorated forward's inference-mode block, not
        ahead of it: the rewrite keeps the block's work where the model put it."""
        from dcp_pass.backend import inference_mode_block

        class Decorated(IntPositionRotary):
            @torch.inference_mode()
            def forward(self, q, k, start_pos: int):
                return super().forward(q, k, start_pos)

        be = Captured()
        m = Decorated()
        q, k, step = self._int_inputs(3, torch.float32)
        got = torch.compile(m, backend=be)(q, k, step)
        self.assertEqual(be.counts, [2])
        self.assertIsNotNone(inference_mode_block(be.graphs[0]))
        torch.testing.assert_close(got, m(q, k, step), equal_nan=True)

    def test_option(self):
        self.assertIsNone(DcpOptions().complex_as_real)  # on with inner='inductor' only
        self.assertFalse(DcpOptions.from_mapping({"complex_as_real": False}).complex_as_real)
        with pytest.raises(DcpOptionError, match="complex_as_real"):
            DcpOptions.from_mapping({"complex_as_real": "yes"})


def test_complex_mul_real_matches_complex_multiply_fp64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, 2, dtype=torch.float64, generator=g)
    f = torch.randn(1, 3, 1, 2, dtype=torch.float64, generator=g)
    want = torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(f.contiguous()))
    torch.testing.assert_close(complex_mul_real(x, f), want, rtol=1e-15, atol=1e-15)
