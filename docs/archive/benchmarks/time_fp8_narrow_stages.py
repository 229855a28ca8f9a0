"""The staged narrow fp8 kernel's variants (source edits) timed side by side, CUDA-graph replay
(results/fp8_narrow_stages_h200.json, nvidia-h200, 2026-12-03); copy it back into `benchmarks/`
to run it; its anchors match the kernel as of 1f7b96a only in part."""
import importlib.util, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
import torch
import bench_fp8 as F8
from common import bench, graph_of
from dcp_pass.runtime.decode.kernels.common import launch
from dcp_pass.runtime.decode.backends import attend
from ablate_fp8_narrow import cut

SRC = open(os.path.join(HERE, "..", "dcp_pass/runtime/decode/kernels/mla_gluon_fp8_narrow.py")).read()
SRC = SRC.replace("from .", "from dcp_pass.runtime.decode.kernels.")


def module(name, src):
    path = os.path.join(HERE, f"_staged_{name}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"_staged_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def src_of(tags):
    src = SRC
    if "ld8x4" in tags:
        src = src.replace("ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])",
                          "ld: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])")
        src = src.replace("gl.SwizzledSharedLayout(4, 1, 1, [1, 0])", "gl.SwizzledSharedLayout(16, 1, 2, [1, 0])")
    if "one_block" in tags:
        src = src.replace("""    for blk in gl.static_range(4):
        _async_load(stage_s.index(blk), rows + blk * (SB // 4), mask=keep)""", """    _async_load(stage_s, rows, mask=keep)""")
        src = src.replace("w = gl.arange(0, SB // 4, layout=gl.SliceLayout(0, ld))", "w = gl.arange(0, DL // 4, layout=gl.SliceLayout(0, ld))")
        src = src.replace("""    return (stage_s.index(0).load(ld), stage_s.index(1).load(ld), stage_s.index(2).load(ld),
            stage_s.index(3).load(ld))""", """    x = stage_s.load(ld)
    return x, x, x, x""")
        src = src.replace("""        tile.slice(0, SB, dim=1).store(_to_f16(x0))
        tile.slice(SB, SB, dim=1).store(_to_f16(x1))
        tile.slice(2 * SB, SB, dim=1).store(_to_f16(x2))
        tile.slice(3 * SB, SB, dim=1).store(_to_f16(x3))""", """        tile.store(_to_f16(x0))""")
        src = src.replace("gl.allocate_shared_memory(gl.int32, [4, BLOCK_N, SB // 4], gl.SwizzledSharedLayout(16, 1, 2, [1, 0]))",
                          "gl.allocate_shared_memory(gl.int32, [BLOCK_N, DL // 4], gl.SwizzledSharedLayout(16, 1, 2, [1, 0]))")
    if "no_score" in tags:
        src = cut(src, "        zero = gl.zeros([BLOCK_N, BLOCK_R]", "        mbarrier.arrive(empty.index(buf))  # the converter", "")
    return src


def run(mod, call, extra):
    out, lse, plan = mod.launch_args(call.shard())
    grid, args, consts, stage2 = plan
    launch(mod._narrow_jit, grid, args, dict(consts, **extra), 4)
    k, g2, a2, c2, w = stage2
    launch(k, g2, a2, c2, w)
    return out, lse


VARIANTS = [("late", (), 1), ("late", (), 0), ("one_block", ("one_block",), 1), ("ns_late", ("no_score",), 1),
            ("ns_one_block", ("one_block", "no_score"), 1)]


def main():
    mods = {}
    rows = []
    for H, B, T in ((16, 8, 131072), (16, 32, 32768), (16, 8, 32768), (16, 32, 131072)):
        sets = F8.make_sets(B, H, T, True)
        ref = attend(F8.fp8_call(*sets[0]), "gluon_fp8")[0].float()
        for name, tags, l2 in VARIANTS:
            if name not in mods:
                mods[name] = module(name, src_of(tags))
            mod = mods[name]
            calls = [(lambda s=s: run(mod, F8.fp8_call(*s), dict(L2_AHEAD=l2))) for s in sets]
            try:
                o = calls[0]()[0].float(); torch.cuda.synchronize()
                err = ((o - ref).norm() / ref.norm()).item()
                ms = bench(graph_of(calls)) / len(calls)
            except Exception as e:  # noqa: BLE001
                ms, err = f"{type(e).__name__}: {e}"[:300], None
            rows.append(dict(H=H, B=B, T=T, variant=name, L2_AHEAD=l2, ms=ms, diff_vs_gluon_fp8=err))
            print(json.dumps(rows[-1]), flush=True)
        bsets = F8.make_sets(B, H, T, False)
        calls = [(lambda s=s: attend(F8.bf16_call(*s), "split")) for s in bsets]
        calls[0](); torch.cuda.synchronize()
        rows.append(dict(H=H, B=B, T=T, variant="bf16_split", ms=bench(graph_of(calls)) / len(calls)))
        print(json.dumps(rows[-1]), flush=True)
        del sets, bsets
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "time_staged.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
