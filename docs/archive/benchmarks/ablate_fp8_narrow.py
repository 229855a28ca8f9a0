"""Diagnostics of the narrow fp8 kernel (2026-12-03, nvidia-h200): which part bounds a tile? Source-edited
copies: no_cvt (the e4m3 -> f16 conversion replaced by moves), no_score (the scorers only
wait for a tile and hand it back), no_score_no_cvt (both). Timed beside the full kernel and
the bf16 split kernel on the same shapes (CUDA-graph replay, rotated inputs). Its text
anchors are those of the kernel at 2d629c6 (the register-staged converter) and, for NAMES
now set, of 1f7b96a; copy it back into `benchmarks/` to run it."""
import importlib.util, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))

SRC = open(os.path.join(HERE, "..", "dcp_pass/runtime/decode/kernels/mla_gluon_fp8_narrow.py")).read()
SRC = SRC.replace("from .", "from dcp_pass.runtime.decode.kernels.")
MOVES = '''_E4M3_F16_ASM_TEXT = """{
mov.b32 {$0, $1}, $4;
mov.b32 {$2, $3}, $4;
}"""
'''


def cut(src, begin, end, new):
    i = src.index(begin)
    j = src.index(end, i)
    return src[:i] + new + src[j:]


def variant_src(name):
    src = SRC
    if "no_cvt" in name:
        src = cut(src, '_E4M3_F16_ASM_TEXT = """{', "\n\ndef _to_f16_src", MOVES)
    if "no_score" in name:
        src = cut(src, "        zero = gl.zeros([BLOCK_N, BLOCK_R]", "        mbarrier.arrive(empty.index(buf))  # the converter",
                  "")
    if "no_rope" in name:
        src = src.replace("""        _async_load(rope_s.index(buf), kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                    mask=((t0 + nr) < end)[:, None])
        cp.mbarrier_arrive(full.index(buf), increment_count=False)
""", "")
        src = src.replace("mbarrier.init(full.index(i), count=128 + 1)", "mbarrier.init(full.index(i), count=1)")
    if "quarter_store" in name:
        src = src.replace("""        tile.slice(0, SB, dim=1).store(_to_f16(x0))
        tile.slice(SB, SB, dim=1).store(_to_f16(x1))
        tile.slice(2 * SB, SB, dim=1).store(_to_f16(x2))
        tile.slice(3 * SB, SB, dim=1).store(_to_f16(x3))""", """        tile.slice(0, SB, dim=1).store(_to_f16(x0 ^ x1 ^ x2 ^ x3))""")
    if "interleave" in name:
        src = cut(src, "def _converter_src(", "\n\ndef _store_block_src", INTERLEAVED)
        src = src.replace("    _put = gluon.jit(_put_src)", "    _put = gluon.jit(_put_src)\n    _put_next = gluon.jit(_put_next_src)")
    return src


INTERLEAVED = '''def _put_next_src(j, salt, full, tile_s, rope_s, sc_s, x0, x1, x2, x3, c0, c1, c2, c3, kv_words, ks_row, kt_row,
                  sks_t, sks_c, start, end, n_tiles, SKV_W: gl.constexpr, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile j into its buffer (as _put), the next tile's words loaded block by block as each
    block's registers are stored (the loads overlap the stores)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    kn = start + (j + 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    keep = kn < end
    t = kn.to(gl.int64)
    ld_s: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ks = start + (j + 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=ld_s)
    ts = ks.to(gl.int64) * sks_t
    if j < n_tiles:
        buf = _opaque(j + salt) % 2
        t0 = start + j * BLOCK_N
        ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        nr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
        cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_r))
        _async_load(rope_s.index(buf), kt_row + (t0 + nr).to(gl.int64)[:, None] * SKT_T + cr[None, :],
                    mask=((t0 + nr) < end)[:, None])
        cp.mbarrier_arrive(full.index(buf), increment_count=False)
        tile = tile_s.index(buf)
        tile.slice(0, SB, dim=1).store(_to_f16(x0))
        x0 = _load_block(kv_words, t, keep, 0, SKV_W, BLOCK_N)
        tile.slice(SB, SB, dim=1).store(_to_f16(x1))
        x1 = _load_block(kv_words, t, keep, 1, SKV_W, BLOCK_N)
        tile.slice(2 * SB, SB, dim=1).store(_to_f16(x2))
        x2 = _load_block(kv_words, t, keep, 2, SKV_W, BLOCK_N)
        tile.slice(3 * SB, SB, dim=1).store(_to_f16(x3))
        x3 = _load_block(kv_words, t, keep, 3, SKV_W, BLOCK_N)
        sc_s.index(4 * buf).store(c0)
        sc_s.index(4 * buf + 1).store(c1)
        sc_s.index(4 * buf + 2).store(c2)
        sc_s.index(4 * buf + 3).store(c3)
        c0 = gl.load(ks_row + ts, mask=ks < end, other=0.0)
        c1 = gl.load(ks_row + ts + sks_c, mask=ks < end, other=0.0)
        c2 = gl.load(ks_row + ts + 2 * sks_c, mask=ks < end, other=0.0)
        c3 = gl.load(ks_row + ts + 3 * sks_c, mask=ks < end, other=0.0)
        fence_async_shared()
        mbarrier.arrive(full.index(buf))
    return x0, x1, x2, x3, c0, c1, c2, c3


def _converter_src(salt, tile_s, rope_s, sc_s, full, empty, kv_words, ks_row, kt_row, sks_t, sks_c, start, end,
                   n_tiles, SKV_W: gl.constexpr, SKT_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """(interleaved) each tile's stores overlap the next tile's loads."""
    x0, x1, x2, x3, c0, c1, c2, c3 = _load_tile(0, kv_words, ks_row, sks_t, sks_c, start, end, SKV_W, BLOCK_N)
    x0, x1, x2, x3, c0, c1, c2, c3 = _put_next(0, salt, full, tile_s, rope_s, sc_s, x0, x1, x2, x3, c0, c1, c2, c3,
                                               kv_words, ks_row, kt_row, sks_t, sks_c, start, end, n_tiles, SKV_W,
                                               SKT_T, BLOCK_N)
    x0, x1, x2, x3, c0, c1, c2, c3 = _put_next(1, salt, full, tile_s, rope_s, sc_s, x0, x1, x2, x3, c0, c1, c2, c3,
                                               kv_words, ks_row, kt_row, sks_t, sks_c, start, end, n_tiles, SKV_W,
                                               SKT_T, BLOCK_N)
    for j in range(n_tiles):
        buf = _opaque(j + salt) % 2
        mbarrier.wait(empty.index(buf), (j // 2) & 1)
        x0, x1, x2, x3, c0, c1, c2, c3 = _put_next(j + 2, salt, full, tile_s, rope_s, sc_s, x0, x1, x2, x3, c0, c1,
                                                   c2, c3, kv_words, ks_row, kt_row, sks_t, sks_c, start, end,
                                                   n_tiles, SKV_W, SKT_T, BLOCK_N)
'''


def variant(name):
    path = os.path.join(HERE, f"_ablate_{name}.py")
    with open(path, "w") as f:
        f.write(variant_src(name))
    spec = importlib.util.spec_from_file_location(f"_ablate_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NAMES = ("full", "no_score")


def main():
    import torch
    import bench_fp8 as F8
    from common import bench, graph_of, copy_bandwidth
    from dcp_pass.runtime.decode.backends import attend
    out = [dict(copy_bw=copy_bandwidth())]
    for H, B, T in ((16, 8, 131072), (16, 32, 32768)):
        sets = F8.make_sets(B, H, T, True)
        for name in NAMES + ("bf16_split",):
            if name == "bf16_split":
                bsets = F8.make_sets(B, H, T, False)
                calls = [(lambda s=s: attend(F8.bf16_call(*s), "split")) for s in bsets]
            else:
                mod = variant(name)
                calls = [(lambda s=s, mod=mod: mod.run(F8.fp8_call(*s))) for s in sets]
            try:
                calls[0]()
                torch.cuda.synchronize()
                ms = bench(graph_of(calls)) / len(calls)
            except Exception as e:  # noqa: BLE001
                ms = f"{type(e).__name__}: {e}"[:300]
            rec = dict(H=H, B=B, T=T, variant=name, ms=ms)
            print(json.dumps(rec), flush=True)
            out.append(rec)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ablate_fp8_narrow.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
