"""The fp8 role-split kernel with an L2 prefetch of the tile after the one its loader
loads into registers, timed beside the committed kernel (and bf16 auto) on the same inputs
(results/fp8_roles_l2_prefetch_h200.json, nvidia-h200, 2026-12-03); copy it back into
`benchmarks/` to run it."""
import importlib.util, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))

PF = '''

def _prefetch_next_src(kv_words, t0, end, SKV_W: gl.constexpr, BLOCK_N: gl.constexpr):
    """(scratch) key rows [t0, t0 + BLOCK_N) into L2: one bulk prefetch a loader warp of a
    warp-uniform range of BLOCK_N / 4 whole rows; ranges past `end` skipped."""
    wl: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[], lane_bases=[[0], [0], [0], [0], [0]],
                                                  warp_bases=[[1], [2]], block_bases=[], shape=[4])
    row = t0 + gl.arange(0, 4, layout=wl) * (BLOCK_N // 4)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [kv_words + row.to(gl.int64) * SKV_W, ((row + BLOCK_N // 4) <= end).to(gl.int32),
                     gl.full([4], SKV_W * 4 * (BLOCK_N // 4), gl.int32, layout=wl)],
        dtype=gl.int32, is_pure=False, pack=1)


def _load_tile_src('''


def variant_src():
    src = open(os.path.join(HERE, "..", "dcp_pass/runtime/decode/kernels/mla_gluon_fp8.py")).read()
    src = src.replace("from .", "from dcp_pass.runtime.decode.kernels.")
    src = src.replace("\n\ndef _load_tile_src(", PF, 1)
    src = src.replace("""    x3, s3 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 3, SKV_W, BLOCK_N)
    return x0, x1, x2, x3, s0, s1, s2, s3""", """    x3, s3 = _load_block(kv_words, ks_row, sks_t, sks_c, t0, end, 3, SKV_W, BLOCK_N)
    _prefetch_next(kv_words, t0 + BLOCK_N, end, SKV_W, BLOCK_N)
    return x0, x1, x2, x3, s0, s1, s2, s3""")
    src = src.replace("    _load_tile = gluon.jit(_load_tile_src)", "    _prefetch_next = gluon.jit(_prefetch_next_src)\n    _load_tile = gluon.jit(_load_tile_src)")
    return src


def variant():
    path = os.path.join(HERE, "_fp8_roles_l2.py")
    open(path, "w").write(variant_src())
    spec = importlib.util.spec_from_file_location("_fp8_roles_l2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    import torch
    import bench_fp8 as F8
    from common import bench, graph_of
    from dcp_pass.runtime.decode.backends import attend
    from dcp_pass.runtime.decode.kernels import mla_gluon_fp8 as G
    V = variant()
    rows = []
    for H, B, T in ((128, 8, 32768), (128, 8, 131072), (128, 32, 32768), (64, 8, 131072)):
        sets = F8.make_sets(B, H, T, True)
        ref = None
        for rep in range(2):
            for name, mod in (("gluon_fp8", G), ("gluon_fp8_l2", V)):
                calls = [(lambda s=s, mod=mod: mod.run(F8.fp8_call(*s))) for s in sets]
                o = calls[0]()[0].float(); torch.cuda.synchronize()
                ref = o if ref is None else ref
                ms = bench(graph_of(calls)) / len(calls)
                rows.append(dict(H=H, B=B, T=T, variant=name, rep=rep, ms=ms,
                                 diff=((o - ref).norm() / ref.norm()).item()))
                print(json.dumps(rows[-1]), flush=True)
        del sets
        bsets = F8.make_sets(B, H, T, False)
        calls = [(lambda s=s: attend(F8.bf16_call(*s), None)) for s in bsets]
        calls[0](); torch.cuda.synchronize()
        rows.append(dict(H=H, B=B, T=T, variant="bf16_auto", ms=bench(graph_of(calls)) / len(calls)))
        print(json.dumps(rows[-1]), flush=True)
        del bsets
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_roles_l2.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
