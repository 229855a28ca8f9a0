r"""Narrow fp8 kernel builds timed side by side with the bf16 split kernel, after a check of each
build's output against _base's on ragged lengths (0 to 3000 keys, 1 / 3 / 16 splits).

Module files beside this script: `_base.py` is kernels/mla_gluon_fp8_narrow.py at 585a7ec with
absolute imports (`from dcp_pass.runtime.decode.kernels.common import ...`); the others are that
file with a patch applied: `_c2.py` fp8_narrow_two_converters.patch, `_regs.py`
fp8_narrow_register_operands.patch (a prototype: loader warpgroup, register operands),
`_rs.py` fp8_narrow_register_staging.patch (odd tiles loaded into the converter's registers,
two tiles in flight), `_sc.py` fp8_narrow_scales_in_ring.patch (each tile's scales copied by
cp.async with its rope rows, read by the scorers), `_pre2.py` fp8_narrow_early_conversion.patch
(blocks 0 and 1 converted before the wait for a free buffer; `_scpre2` / `_scpre4`: the same
edit on `_sc.py`, two or four blocks). From the kernel at 0c64846 (`git show
0c64846:...`, the same import edit): `_p.py` unchanged, `_tma.py` with fp8_narrow_tma_words.patch
(the converter's words staged by TMA: four 128-byte-wide boxes into a 128-byte-swizzled buffer,
one mbarrier with the bytes expected, rows past the split zeroed in registers; the scales,
rope rows and mask entries as before; Triton 3.6: 24 bytes spilled), `_vs.py` with
fp8_narrow_vector_scales.patch (one 16-byte load of a key's four scales), `_pb.py` with
fp8_narrow_block_handoff.patch (full / empty barriers per 128-column block), `_half.py` with
fp8_narrow_column_split_scorers.patch (both scorers on every tile, each over two latent blocks,
partial scores added through shared memory; one partial a split). From `_regs.py`: `_f8s.py` with
fp8_narrow_fp8_scores.patch (the score product in fp8 from the staged bytes, the queries as two
e4m3 parts), then `_f8sv.py` = `_f8s.py` with fp8_narrow_fp8_scores_staged_scales.patch (two block
accumulators in flight, added as each is done; the scales staged block-major; the design the
product took at the seventh stop); `_f8sq.py` is `_f8sv.py` with the scales staged as before;
`_f8s3q.py` is `_f8sq.py` with a third scorer (SCORERS = 3, registers 152 / 56: 80 bytes spilled);
`_f8sqp.py` is `_f8sq.py` with `max_num_imprecise_acc=32` on the four fp8 score wgmmas (each k32
step's sum promoted to fp32: 120 bytes spilled). Generated builds: a name's suffix edits its
base's source (`_a2`/`a2`: L2_AHEAD 2; `_nopv`: no value products; `_noqk`: no latent score
products; `_nostore`: no f16 stores; `_nosc`: no scale loads; `_norope`: no rope copies;
`_nol2`: no L2 prefetch; `_cp4x8`: copies 4 rows x 8 threads, read back after a barrier);
the second list's builds are also timed with scorers that only hand buffers back ("ns"; for
`_regs`: its loader's stream alone).
To build a module file (then carry the folder to the GPU machine):

    git show 585a7ec:dcp_pass/runtime/decode/kernels/mla_gluon_fp8_narrow.py > k.py
    patch k.py fp8_narrow_register_operands.patch      # (none for _base.py)
    sed -e 's/^from \./from dcp_pass.runtime.decode.kernels./' \
        -e 's/^    from \./    from dcp_pass.runtime.decode.kernels./' k.py > _regs.py

SHORT=1: one shape, one pass, 16 splits in the ragged check. Run 2026-12-03 on nvidia-h200 from
`scratch/` (results/fp8_narrow_converters_h200.json):

    python time_fp8_narrow_variants.py _base,_c2,_c2a2 _base,_c2
    python time_fp8_narrow_variants.py _base,_base_nopv,_base_noqk,_base_nostore _base,_base_nostore
    python time_fp8_narrow_variants.py _base _base_nostore,_base_nosc_nostore,_base_norope_nostore,...

and later that day (results/fp8_narrow_copies_h200.json; the product took `_pre2_cp4x8`):

    SHORT=1 python time_fp8_narrow_variants.py _base,_regs ""
    SHORT=1 python time_fp8_narrow_variants.py _base,_base_cp4x8 ""
    python time_fp8_narrow_variants.py _base,_rs,_rs_nol2 ""
    python time_fp8_narrow_variants.py _base,_sc,_sc_cp4x8,_scpre2,_scpre4,_scpre2_cp4x8 _sc_cp4x8
    python time_fp8_narrow_variants.py _base,_base_cp4x8,_pre2,_pre2_cp4x8 ""

and at the sixth stop (results/fp8_narrow_loaders_h200.json; none taken):

    python time_fp8_narrow_variants.py _base,_p,_tma,_regs _p,_tma,_regs
    python time_fp8_narrow_variants.py _base,_p,_vs _p,_vs
    python time_fp8_narrow_variants.py _base,_p,_pb ""
    python time_fp8_narrow_variants.py _base,_p,_half ""

and at the seventh stop (results/fp8_narrow_fp8_scores_h200.json, three runs; the product took `_f8sv`):

    python time_fp8_narrow_variants.py _base,_p,_f8s _f8s
    SHORT=1 python time_fp8_narrow_variants.py _base,_p,_f8s,_f8sq,_f8s3q,_f8sqp _f8s3q
    python time_fp8_narrow_variants.py _base,_p,_f8sq,_f8sv _f8sv

and on 2026-12-04 (results/fp8_narrow_tma_h200.json, three runs; the product took the TMA loader
as `_p2`). `_base.py` is then the kernel at 721f22d; `_t3.py` is it with
fp8_narrow_tma_three_scorers.patch (a TMA loader for the bytes and rope rows, scales by cp.async,
three scorers at 160 / 32 registers), `_t3b.py` that with 168 / 24, `_t2.py` that with SCORERS = 2
and 200 / 112; `_p2.py` is the kernel at ec215ce (rank-3 boxes, scales by TMA too):

    python time_fp8_narrow_variants.py _base,_t3,_t3b ""
    python time_fp8_narrow_variants.py _base,_t2 _base,_t2
    python time_fp8_narrow_variants.py _base,_p2 _p2

and at the second stop of 2026-12-04 (results/fp8_narrow_prologue_pdl_h200.json and
results/fp8_narrow_scorer_cuts_h200.json; none taken). `_base.py` is then the kernel at 2f3a314;
`_q1a.py` it with fp8_narrow_one_query_load.patch, `_pdl.py` with fp8_narrow_pdl_merge.patch,
`_j.py` with fp8_narrow_joined_reduction.patch, `_jb.py` `_j.py` with
fp8_narrow_plain_barrier.patch, `_lzj.py` `_j.py` with fp8_narrow_lazy_rescale.patch (`_lz.py`:
that patch's lazy rescale alone on `_base.py`). SHAPES (e.g. 16x32x131072,16x8x131072) and REPS
set the timed shapes and passes; every build is also checked against `_base` on logits and key
scales that grow and shrink along the keys (growth_check):

    python time_fp8_narrow_variants.py _base,_q1a,_pdl ""
    SHAPES=16x8x32768,16x8x131072,16x32x32768,16x32x131072 python time_fp8_narrow_variants.py _base,_lz,_lzj ""
    REPS=3 SHAPES=16x8x131072,16x32x32768,16x32x131072 python time_fp8_narrow_variants.py _base,_j,_jb,_lzj ""
    REPS=6 SHORT=1 SHAPES=16x32x131072,16x8x131072 python time_fp8_narrow_variants.py _base,_lzj ""

and `_pq.py` (fp8_narrow_queries_in_scorer.patch; results/fp8_narrow_queries_in_scorer_h200.json):

    REPS=4 SHAPES=16x8x32768,16x8x131072,16x32x32768,16x32x131072 python time_fp8_narrow_variants.py _base,_pq ""

and at the third stop of 2026-12-04, `_early.py` (fp8_narrow_tiles_before_queries.patch on the kernel at
8af8e57, the same as 2f3a314; results/fp8_narrow_tiles_before_queries_h200.json):

    REPS=4 SHAPES=16x8x32768,16x8x131072,16x32x32768,16x32x131072 python time_fp8_narrow_variants.py _base,_early ""
"""
import importlib.util, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "archive", "benchmarks"))
import torch
import bench_fp8 as F8
from common import bench, graph_of
from dcp_pass.runtime.decode.backends import attend


def cut(src, begin, end, new):
    i = src.index(begin)
    return src[:i] + new + src[src.index(end, i):]


def module(name, src=None):
    path = os.path.join(HERE, f"{name}.py")
    if src is not None:
        path = os.path.join(HERE, f"_gen{name}.py")
        open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nopv(src):
    return cut(src, "        # O^T += V^T P^T", "        mbarrier.arrive(empty.index(buf))  # the converter", "")


def _noqk(src):
    src = cut(src, "        s0 = warpgroup_mma(tile.slice(0, SB", "        c0 = sc_s.index(4 * buf).load(key_l)",
              "        s0 = zero\n        s1 = zero\n        s2 = zero\n        s3 = zero\n")
    return src.replace("sr, s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=[sr, s0, s1, s2, s3])",
                       "sr = warpgroup_mma_wait(0, deps=[sr])")


def _nostore(src):  # the converter's f16 stores gone (its conversions too: their results unused)
    return cut(src, "        tile.slice(0, SB, dim=1).store(_to_f16(x0))", "        sc_s.index(4 * buf).store(c0)", "")


def _nosc(src):  # no scale loads: every scale 1.0
    return cut(src, "    c0 = gl.load(ks_row + ts, mask=ks < end, other=0.0)", "    return c0, c1, c2, c3",
               "    c0 = gl.full([BLOCK_N], 1.0, gl.float32, layout=ld_s)\n    c1 = c0\n    c2 = c0\n    c3 = c0\n")


def _norope(src):  # no rope copies (the slot barriers still complete)
    return cut(src, "        _async_load(rope_s.index(slot)", "        cp.mbarrier_arrive(rope_full", "")


def _cp4x8(src):  # copies 4 rows x 8 threads a warp (128 B of a row each), read back 8 x 4 after a barrier
    a = "    ld: gl.constexpr = _WORDS_LAYOUT\n    k = start + j * BLOCK_N"
    assert src.count(a) == 1
    src = src.replace(a, "    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])\n    k = start + j * BLOCK_N")
    b = """    cp.wait_group(OUTSTANDING)
    return (stage_s.index(0).load(ld), stage_s.index(1).load(ld), stage_s.index(2).load(ld),
            stage_s.index(3).load(ld))"""
    assert src.count(b) == 1
    return src.replace(b, """    cp.wait_group(OUTSTANDING)
    _barrier()  # every thread's copies landed (a thread reads pieces others copied)
    x = (stage_s.index(0).load(ld), stage_s.index(1).load(ld), stage_s.index(2).load(ld),
         stage_s.index(3).load(ld))
    _barrier()  # every read done before the next tile's copies overwrite the buffer
    return x""")


GEN = {"cp4x8": _cp4x8, "nosc": _nosc, "norope": _norope, "nol2": lambda s: s.replace("L2_AHEAD = 1  #", "L2_AHEAD = 0  #"),
       "a2": lambda s: s.replace("L2_AHEAD = 1  #", "L2_AHEAD = 2  #"), "nopv": _nopv, "noqk": _noqk,
       "nostore": _nostore}


def source(name):
    for tag, fn in GEN.items():
        if name.endswith("_" + tag) or (tag == "a2" and name.endswith("a2")):
            return fn(source(name[: -len(tag) - (0 if tag == "a2" else 1)]))
    return open(os.path.join(HERE, f"{name}.py")).read()


def no_score(src):
    if "        if t0 + BLOCK_N > end:  # (the split's last tile)" in src:  # the TMA loader's stream alone
        return cut(src, "        valid = (t0 + keys) < end\n        if t0 + BLOCK_N > end:", "\n\n    l_i = gl.sum(l_acc, axis=0)",
                   "        mbarrier.arrive(free.index(slot))")
    if "mbarrier.arrive(free.index(slot))" in src:  # the register-operand prototype: its loader's stream alone
        return cut(src, "        fence_async_shared()  # the copies' writes", "\n\n    l_i = gl.sum(l_acc, axis=0)",
                   "        mbarrier.arrive(free.index(slot))")
    return cut(src, "        zero = gl.zeros([BLOCK_N, BLOCK_R]", "        mbarrier.arrive(empty.index(buf))  # the converter", "")


def ragged_check(mods, rows):
    torch.manual_seed(1)
    B, H, T = 12, 16, 3000
    q = torch.randn(B, 1, H, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(B, T, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([0, 1, 2, 63, 64, 65, 127, 129, 1000, 2047, 2999, 3000], device="cuda")
    packed = F8.pack(kv, F8.LAYOUT)
    base = None
    for name, mod in mods.items():
        if name.startswith("ns") or any(name.endswith("_" + t) for t in ("nopv", "noqk", "nostore")):
            continue
        for ns in ((16,) if os.environ.get('SHORT') else (1, 3, 16)):
            o, l = mod.run(F8.fp8_call(q, packed, lens), num_splits=ns)
            torch.cuda.synchronize()
            if base is None or name == "_base" and ns == 1:
                base = (o.float().clone(), l.float().clone())
            r = dict(check="ragged", variant=name, splits=ns,
                     max_abs_out=(o.float() - base[0]).abs().max().item(),
                     lse_diff=(l.float() - base[1]).nan_to_num(0.0, 0.0, 0.0).abs().max().item(),
                     lse_inf_same=bool(((l == float("-inf")) == (base[1] == float("-inf"))).all().item()))
            rows.append(r); print(json.dumps(r), flush=True)


SHAPES = ((16, 8, 131072),) if os.environ.get('SHORT') else ((16, 8, 131072), (16, 32, 32768))
if os.environ.get('SHAPES'):
    SHAPES = tuple(tuple(int(x) for x in s.split('x')) for s in os.environ['SHAPES'].split(','))


def growth_check(mods, rows):
    """Logits and key scales that grow (and shrink) along the keys: the running max and P's unit
    move in many tiles, by more and by less than any threshold; each build against _base."""
    torch.manual_seed(2)
    B, H, T = 4, 16, 8192
    q = torch.randn(B, 1, H, 576, dtype=torch.bfloat16, device="cuda")
    ramp = torch.linspace(0.05, 6.0, T, device="cuda")
    wave = 1 + 4 * torch.sin(torch.linspace(0, 30, T, device="cuda")).abs()
    for kind, f in (("up", ramp), ("down", ramp.flip(0)), ("wave", wave)):
        kv = (torch.randn(B, T, 576, device="cuda") * f[None, :, None]).to(torch.bfloat16)
        lens = torch.tensor([T, T - 1, 4097, 65], device="cuda")
        packed = F8.pack(kv, F8.LAYOUT)
        ref = None
        for name, mod in mods.items():
            if name.startswith("ns"):
                continue
            o, l = mod.run(F8.fp8_call(q, packed, lens), num_splits=4)
            torch.cuda.synchronize()
            if ref is None:
                ref = (o.float().clone(), l.float().clone())
            r = dict(check="growth", kind=kind, variant=name,
                     rel_out=((o.float() - ref[0]).norm() / ref[0].norm()).item(),
                     max_abs_out=(o.float() - ref[0]).abs().max().item(),
                     lse_diff=(l.float() - ref[1]).abs().max().item(), nan=bool(o.isnan().any().item()))
            rows.append(r); print(json.dumps(r), flush=True)


def main():
    names = sys.argv[1].split(",")
    mods = {n: module(n, source(n) if not os.path.exists(os.path.join(HERE, f"{n}.py")) else None) for n in names}
    mods.update({"ns" + n: module("ns" + n, no_score(source(n))) for n in sys.argv[2].split(",") if n})
    rows = []
    ragged_check(mods, rows)
    growth_check(mods, rows)
    for H, B, T in SHAPES:
        sets = F8.make_sets(B, H, T, True)
        ref = mods["_base"].run(F8.fp8_call(*sets[0]))[0].float()
        for rep in range(int(os.environ.get("REPS", "1" if os.environ.get("SHORT") else "2"))):
            for name, mod in mods.items():
                calls = [(lambda s=s, mod=mod: mod.run(F8.fp8_call(*s))) for s in sets]
                try:
                    o = calls[0]()[0].float(); torch.cuda.synchronize()
                    err = ((o - ref).norm() / ref.norm()).item()
                    ms = bench(graph_of(calls)) / len(calls)
                except Exception as e:  # noqa: BLE001
                    ms, err = f"{type(e).__name__}: {e}"[:300], None
                rows.append(dict(H=H, B=B, T=T, variant=name, rep=rep, ms=ms, diff_vs_base=err))
                print(json.dumps(rows[-1]), flush=True)
        bsets = F8.make_sets(B, H, T, False)
        calls = [(lambda s=s: attend(F8.bf16_call(*s), "split")) for s in bsets]
        calls[0](); torch.cuda.synchronize()
        rows.append(dict(H=H, B=B, T=T, variant="bf16_split", ms=bench(graph_of(calls)) / len(calls)))
        print(json.dumps(rows[-1]), flush=True)
        del sets, bsets
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "time_mods.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
