"""Can the narrow fp8 kernel's two products take their 64-row operand from registers, converted
from the staged fp8 bytes, with no data movement between threads (no f16 tile in shared memory)?

* scores ``S^T = K Q^T``: A = a 128-column block of K [64 keys, 128], each thread's 4-byte
  words converted to f16 in the wgmma's register layout when the block's columns are permuted
  (logical 16kk + 8hi + 2c + i <-> physical 16kk + 4c + 2hi + i; Q stored permuted alike);
* values ``O^T = V^T P^T``: A = V^T [128 value columns, 64 keys] from the [keys, columns]
  bytes: one 4-byte word per key row, two keys' bytes paired by `prmt` before each conversion,
  the value columns permuted (logical 16w + r + 8a + 64b <-> physical 4(8w + r) + a + 2b; the
  output stored back in place), the keys in natural order (P^T unchanged).

Both compile with ``convert_layout(..., assert_trivial=True)`` on Triton 3.6 (sm_90) and, on a
GPU, match torch on the permuted columns. Run 2026-12-03 (results/fp8_register_operands_h200.json):
``python probe_fp8_register_operands.py`` (offline compile; plus the check where a GPU is)."""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from offline_wide import cubin_report

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dcp_pass.runtime.decode.kernels.mla_gluon_fp8_narrow import _E4M3_F16_ASM_TEXT  # noqa: E402

ASM = gl.constexpr(_E4M3_F16_ASM_TEXT)  # the narrow kernel's: four e4m3 of a word -> four f16


@gluon.jit
def scores_from_registers(W, Qp, O, REG_ORDER: gl.constexpr):
    # words [64 keys, 32 words] of one 128-column block: thread (warp w, lane l) holds keys
    # 16w + l//4 (+8) and words 4kk + l%4
    if REG_ORDER == 0:
        wl: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0], [0, 4], [0, 8], [0, 16]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
    else:
        wl: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 4], [0, 8], [0, 16], [8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, wl))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, wl))
    x = gl.load(W + r[:, None] * 32 + c[None, :])
    v0, v1, v2, v3 = gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,r", [x], dtype=(gl.float16,) * 4, is_pure=True,
                                               pack=1)
    a = gl.join(gl.join(v0, v1), gl.join(v2, v3))  # [64, 32, i, hi]
    a = gl.reshape(a, [64, 8, 4, 2, 2])  # [key, kk, c, i, hi]
    a = gl.permute(a, (0, 1, 4, 2, 3))  # [key, kk, hi, c, i]
    a = gl.reshape(a, [64, 128])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    a = gl.convert_layout(a, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    q_s = gl.allocate_shared_memory(gl.float16, [16, 128], gl.NVMMASharedLayout.get_default_for([16, 128], gl.float16))
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, ql))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, ql))
    q_s.store(gl.load(Qp + qr[:, None] * 128 + qc[None, :]))
    fence_async_shared()
    acc = warpgroup_mma(a, q_s.permute((1, 0)), gl.zeros([64, 16], gl.float32, layout=mma))
    orr = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    occ = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
    gl.store(O + orr[:, None] * 16 + occ[None, :], acc)



# byte j of word a (key 2c + 8hi + 16kk) and of word b (the next key) -> one f16x2 (a low), j = 0..3
ASM_PAIRS = gl.constexpr("""{
.reg .b32 t, p;
.reg .b16 l, u;
prmt.b32 t, $8, $9, 0x40;
mov.b32 {l, u}, t;
cvt.rn.f16x2.e4m3x2 p, l;
mov.b32 {$0, $1}, p;
prmt.b32 t, $8, $9, 0x51;
mov.b32 {l, u}, t;
cvt.rn.f16x2.e4m3x2 p, l;
mov.b32 {$2, $3}, p;
prmt.b32 t, $8, $9, 0x62;
mov.b32 {l, u}, t;
cvt.rn.f16x2.e4m3x2 p, l;
mov.b32 {$4, $5}, p;
prmt.b32 t, $8, $9, 0x73;
mov.b32 {l, u}, t;
cvt.rn.f16x2.e4m3x2 p, l;
mov.b32 {$6, $7}, p;
}""")


@gluon.jit
def values_from_registers(W, P, O):
    # words [64 keys, 32 quads]: thread (warp w, lane l) holds keys 2(l%4) + i + 8hi + 16kk and quad 8w + l//4
    wl: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, wl))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, wl))
    x = gl.load(W + r[:, None] * 32 + c[None, :])
    x = gl.reshape(x, [4, 2, 4, 2, 32])  # [kk, hi, c, i, q]
    x = gl.permute(x, (0, 1, 2, 4, 3))  # [kk, hi, c, q, i]
    xa, xb = gl.split(x)
    o = gl.inline_asm_elementwise(ASM_PAIRS, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [xa, xb], dtype=(gl.float16,) * 8,
                                  is_pure=True, pack=1)
    j0 = gl.join(o[0], o[1])
    j1 = gl.join(o[2], o[3])
    j2 = gl.join(o[4], o[5])
    j3 = gl.join(o[6], o[7])
    t = gl.join(gl.join(j0, j1), gl.join(j2, j3))  # [kk, hi, c, q, i, a, b]
    t = gl.reshape(t, [4, 2, 4, 4, 8, 2, 2, 2])  # [kk, hi, c, w, r, i, a, b]
    t = gl.permute(t, (7, 3, 6, 4, 0, 1, 2, 5))  # [b, w, a, r, kk, hi, c, i]
    a = gl.reshape(t, [128, 64])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    a = gl.convert_layout(a, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    p_s = gl.allocate_shared_memory(gl.float16, [64, 16], gl.NVMMASharedLayout.get_default_for([64, 16], gl.float16))
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    pr = gl.arange(0, 64, layout=gl.SliceLayout(1, pl))
    pc = gl.arange(0, 16, layout=gl.SliceLayout(0, pl))
    p_s.store(gl.load(P + pr[:, None] * 16 + pc[None, :]))
    fence_async_shared()
    acc = warpgroup_mma(a, p_s, gl.zeros([128, 16], gl.float32, layout=mma))
    orr = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    occ = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
    gl.store(O + orr[:, None] * 16 + occ[None, :], acc)


def offline():
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(dict(num_warps=4, num_stages=1))
    div = [["tt.divisibility", 16]]
    rows = {}
    for name, fn, sig, consts in (
            ("scores", scores_from_registers, {"W": "*i32", "Qp": "*fp16", "O": "*fp32", "REG_ORDER": "constexpr"},
             {"REG_ORDER": 0}),
            ("values", values_from_registers, {"W": "*i32", "P": "*fp16", "O": "*fp32"}, {})):
        src = GluonASTSource(fn, sig, consts, {(0,): div, (1,): div, (2,): div})
        r = cubin_report(triton.compile(src, target=target, options=opts.__dict__))
        r.pop("ttgir", None)
        rows[name] = r
    return rows


def check():
    import torch
    torch.manual_seed(0)
    dev = "cuda"
    kv = (torch.randn(64, 128, device=dev) * 2).to(torch.float8_e4m3fn)
    words = kv.view(torch.uint8).contiguous().view(torch.int32)  # [64, 32]
    kf = kv.float()
    res = {}
    # QK: logical col 16kk + 8hi + 2c + i <-> physical 16kk + 4c + 2hi + i
    lg = torch.arange(128)
    kk, rem = lg // 16, lg % 16
    hi, c, i = rem // 8, (rem % 8) // 2, rem % 2
    phys = (16 * kk + 4 * c + 2 * hi + i).to(dev)
    q = torch.randn(16, 128, device=dev).half()
    qp = q[:, phys].contiguous()  # logical column l holds q's physical column phys[l]
    for order in (0, 1):
        o = torch.empty(64, 16, device=dev)
        scores_from_registers[(1,)](words, qp, o, REG_ORDER=order, num_warps=4)
        ref = kf @ q.float().t()
        res[f"qk_order{order}"] = ((o - ref).abs().max() / ref.abs().max()).item()
    # PV: logical row m = 16w + r + 8a + 64b <-> physical column 4(8w + r) + a + 2b
    m = torch.arange(128)
    b, rest = m // 64, m % 64
    w, rest = rest // 16, rest % 16
    a, r = rest // 8, rest % 8
    physm = (4 * (8 * w + r) + a + 2 * b).to(dev)
    p = torch.rand(64, 16, device=dev).half()
    o = torch.empty(128, 16, device=dev)
    values_from_registers[(1,)](words, p, o, num_warps=4)
    ref = kf[:, physm].t() @ p.float()
    res["pv"] = ((o - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    import torch
    out = {"offline": offline()}
    if torch.cuda.is_available():
        out["gpu"] = check()
    print(json.dumps(out))
