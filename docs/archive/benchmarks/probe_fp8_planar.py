"""The same fp8 cache values in three layouts, timed with the same kernels: FlashMLA's packed
656-byte row (latent, scales, rope of a token side by side; what the product stores), a planar
copy (three contiguous arrays: latent [B, T, 512] e4m3, scales [B, T, 4] fp32, rope [B, T, 64]
bf16) and 672-byte rows ("row672": latent, rope, scales, 16 bytes of padding; 21 whole 32-byte
sectors, so every part of every row starts on a sector). The kernels take all three through
the same strided views, so the difference is the layout's alone: a packed row starts 16 bytes
into a sector on odd keys and its parts' copies share sectors with their neighbours'.

Checked first: each build's output and LSE on planar inputs against the packed ones (ragged
lengths 0 to 3000), which must be identical. Then per shape: the narrow builds `_p` (the
product kernel at 0c64846) and `_tma` (fp8_narrow_tma_words.patch; planar only, its TMA
descriptor needs batch rows contiguous), each also with scorers that only hand buffers back
("ns": the converter's stream alone); the split kernel on fp8 at 16 heads and the role-split
fp8 kernel at 128 heads, beside the bf16 kernels. Module files as in
time_fp8_narrow_variants.py's docstring; like that script, run from a folder one level below
the repository root that holds both scripts and the module files (the runs used scratch/):

    python probe_fp8_planar.py        # -> $OUT/fp8_planar.json

Run 2026-12-03 on nvidia-h200 (results/fp8_planar_h200.json: twice, the first before row672 was added).
"""
import json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
from time_fp8_narrow_variants import F8, attend, bench, graph_of, module, no_score, source
from dcp_pass.runtime.decode.call import AttentionCall
from dcp_pass.runtime.decode.kv_format import views

SHAPES = ((16, 8, 32768), (16, 8, 131072), (16, 32, 32768), (16, 32, 131072), (128, 8, 32768), (128, 32, 32768))


def planar(rows):
    latent, scales, rope = views(rows, F8.LAYOUT)
    return latent.contiguous(), scales.contiguous(), rope.contiguous()


def row672(rows):
    """The rows re-laid as 672-byte rows (latent | rope | scales | padding); their three views."""
    latent, scales, rope = views(rows, F8.LAYOUT)
    wide = torch.zeros(*rows.shape[:-1], 672, dtype=torch.uint8, device=rows.device)
    wide[..., :512] = latent.view(torch.uint8)
    wide[..., 512:640] = rope.contiguous().view(torch.uint8)
    wide[..., 640:656] = scales.contiguous().view(torch.uint8)
    return wide[..., :512].view(latent.dtype), wide[..., 640:656].view(torch.float32), wide[..., 512:640].view(rope.dtype)


def planar_call(q, parts, lens):
    latent, scales, rope = parts
    return AttentionCall(q[..., :F8.KV_LORA], q[..., F8.KV_LORA:], latent, rope, F8.KV_LORA, F8.SCALE, kv_lens=lens,
                         kv_scale=scales)


def timed(calls):
    calls[0]()
    torch.cuda.synchronize()
    return bench(graph_of(calls)) / len(calls)


def main():
    mods = {n: module(n) for n in ("_p", "_tma")}
    mods.update({"ns" + n: module("ns" + n, no_score(source(n))) for n in ("_p", "_tma")})
    rows = []

    def record(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    torch.manual_seed(1)
    q = torch.randn(12, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
    packed = F8.pack(torch.randn(12, 3000, 576, dtype=torch.bfloat16, device="cuda"), F8.LAYOUT)
    lens = torch.tensor([0, 1, 2, 63, 64, 65, 127, 129, 1000, 2047, 2999, 3000], device="cuda")
    o0, l0 = mods["_p"].run(F8.fp8_call(q, packed, lens))
    for name, layout in (("_p", planar), ("_tma", planar), ("_p", row672)):
        o, lse = mods[name].run(planar_call(q, layout(packed), lens))
        record(check=f"{layout.__name__}_vs_packed", variant=name,
               max_abs_out=(o.float() - o0.float()).abs().max().item(),
               lse_diff=(lse - l0).nan_to_num(0.0, 0.0, 0.0).abs().max().item())
    del q, packed
    for H, B, T in SHAPES:
        sets = {"packed": F8.make_sets(B, H, T, True)}
        sets["planar"] = [(q, planar(r), n) for q, r, n in sets["packed"]]
        sets["row672"] = [(q, row672(r), n) for q, r, n in sets["packed"]]
        make = {"packed": lambda s: F8.fp8_call(*s), "planar": lambda s: planar_call(*s),
                "row672": lambda s: planar_call(*s)}
        for rep in range(2):
            for layout, ss in sets.items():
                builds = [n for n in mods if layout == "planar" or not n.endswith("_tma")] if H == 16 else []
                for name in builds:
                    ms = timed([(lambda s=s, m=mods[name]: m.run(make[layout](s))) for s in ss])
                    record(H=H, B=B, T=T, variant=name, layout=layout, rep=rep, ms=ms)
                for kernel in (("gluon_fp8", "split") if H == 128 else ("split",)):
                    ms = timed([(lambda s=s, k=kernel: attend(make[layout](s), k)) for s in ss])
                    record(H=H, B=B, T=T, variant="fp8_" + kernel, layout=layout, rep=rep, ms=ms)
        del sets
        bsets = F8.make_sets(B, H, T, False)
        for kernel in (("auto", "gluon_seesaw") if H == 128 else ("split",)):
            ms = timed([(lambda s=s, k=kernel: attend(F8.bf16_call(*s)) if k == "auto" else attend(F8.bf16_call(*s), k))
                        for s in bsets])
            record(H=H, B=B, T=T, variant="bf16_" + kernel, ms=ms)
        del bsets
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_planar.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
