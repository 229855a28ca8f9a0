"""Narrow fp8 kernel builds (module files beside this script, named on the command line)
timed side by side, plus the bf16 split kernel: `python benchmarks/time_fp8_narrow_builds.py
_v3,_v4,_v5 _v5` (the second list: builds also timed with scorers that only hand buffers
back) gave results/fp8_narrow_barriers_h200.json on nvidia-h200, 2026-12-03."""
import importlib.util, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import torch
import bench_fp8 as F8
from common import bench, graph_of
from dcp_pass.runtime.decode.backends import attend
from ablate_fp8_narrow import cut


def module(name, src=None):
    path = os.path.join(HERE, f"{name}.py")
    if src is not None:
        path = os.path.join(HERE, f"_gen_{name}.py")
        open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def no_score(name):
    src = open(os.path.join(HERE, f"{name}.py")).read()
    return module(f"ns{name}", cut(src, "        zero = gl.zeros([BLOCK_N, BLOCK_R]",
                                   "        mbarrier.arrive(empty.index(buf))  # the converter", ""))


def main():
    names = sys.argv[1].split(",")
    mods = {n: module(n) for n in names}
    mods.update({"ns" + n: no_score(n) for n in sys.argv[2].split(",") if n})
    rows = []
    for H, B, T in ((16, 8, 131072), (16, 32, 32768), (16, 8, 32768), (16, 32, 131072)):
        sets = F8.make_sets(B, H, T, True)
        ref = attend(F8.fp8_call(*sets[0]), "gluon_fp8")[0].float()
        for rep in range(2):
            for name, mod in mods.items():
                calls = [(lambda s=s, mod=mod: mod.run(F8.fp8_call(*s))) for s in sets]
                try:
                    o = calls[0]()[0].float(); torch.cuda.synchronize()
                    err = ((o - ref).norm() / ref.norm()).item()
                    ms = bench(graph_of(calls)) / len(calls)
                except Exception as e:  # noqa: BLE001
                    ms, err = f"{type(e).__name__}: {e}"[:300], None
                rows.append(dict(H=H, B=B, T=T, variant=name, rep=rep, ms=ms, diff_vs_gluon_fp8=err))
                print(json.dumps(rows[-1]), flush=True)
        bsets = F8.make_sets(B, H, T, False)
        calls = [(lambda s=s: attend(F8.bf16_call(*s), "split")) for s in bsets]
        calls[0](); torch.cuda.synchronize()
        rows.append(dict(H=H, B=B, T=T, variant="bf16_split", ms=bench(graph_of(calls)) / len(calls)))
        print(json.dumps(rows[-1]), flush=True)
        del sets, bsets
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "time_files.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
