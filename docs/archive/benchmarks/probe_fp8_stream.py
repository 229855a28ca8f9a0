"""How fast can one warpgroup a CTA stream 40 KiB tiles (64 rows x 640 bytes: the fp8
latent's 512 bytes + 128 bytes of bf16 rope) with S cp.async stages, or with plain loads held
in registers one tile ahead (the narrow kernel's converter)? Rate vs bytes in flight.

Run 2026-12-03 on nvidia-h200 from `scratch/` (results/fp8_stream_probe_h200.json); copy it
back into `benchmarks/` to run it again: `python benchmarks/probe_fp8_stream.py`."""
import json, os, sys
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _issue(ring_l, ring_r, kv, tile, st, RW: gl.constexpr):
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rl = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l)).to(gl.int64) + tile * 64
    cl = gl.arange(0, 128, layout=gl.SliceLayout(0, ld_l))
    cp.async_copy_global_to_shared(ring_l.index(st), kv + rl[:, None] * RW + cl[None, :])
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_r)).to(gl.int64) + tile * 64
    cr = gl.arange(0, 32, layout=gl.SliceLayout(0, ld_r))
    cp.async_copy_global_to_shared(ring_r.index(st), kv + rr[:, None] * RW + 128 + cr[None, :])
    cp.commit_group()


@gluon.jit
def stream_cp(kv, out, n_per, RW: gl.constexpr, S: gl.constexpr):
    pid = gl.program_id(0)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    sl: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [1, 0])
    ring_l = gl.allocate_shared_memory(gl.int32, [S, 64, 128], sl)
    ring_r = gl.allocate_shared_memory(gl.int32, [S, 64, 32], sl)
    t0 = pid * n_per
    for s in gl.static_range(S - 1):
        _issue(ring_l, ring_r, kv, t0 + s, s, RW)
    acc = gl.zeros([64, 128], gl.int32, ld_l)
    accr = gl.zeros([64, 32], gl.int32, ld_r)
    for j in range(n_per):
        nxt = j + S - 1
        if nxt < n_per:
            _issue(ring_l, ring_r, kv, t0 + nxt, nxt % S, RW)
        else:
            cp.commit_group()
        cp.wait_group(S - 1)
        _barrier()
        acc = acc ^ ring_l.index(j % S).load(ld_l)
        accr = accr ^ ring_r.index(j % S).load(ld_r)
        _barrier()
    gl.store(out + pid, gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(accr, axis=1), axis=0))


@gluon.jit
def _ld(kv, tile, RW: gl.constexpr):
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rl = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l)).to(gl.int64) + tile * 64
    cl = gl.arange(0, 128, layout=gl.SliceLayout(0, ld_l))
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_r)).to(gl.int64) + tile * 64
    cr = gl.arange(0, 32, layout=gl.SliceLayout(0, ld_r))
    return gl.load(kv + rl[:, None] * RW + cl[None, :]), gl.load(kv + rr[:, None] * RW + 128 + cr[None, :])


@gluon.jit
def stream_reg(kv, out, n_per, RW: gl.constexpr):
    pid = gl.program_id(0)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    t0 = pid * n_per
    acc = gl.zeros([64, 128], gl.int32, ld_l)
    accr = gl.zeros([64, 32], gl.int32, ld_r)
    x, xr = _ld(kv, t0, RW)
    for j in range(n_per - 1):
        y, yr = _ld(kv, t0 + j + 1, RW)
        acc = acc ^ x
        accr = accr ^ xr
        x = y
        xr = yr
    acc = acc ^ x
    accr = accr ^ xr
    gl.store(out + pid, gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(accr, axis=1), axis=0))


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from common import bench, copy_bandwidth
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    RW = 160  # words a row (640 bytes)
    rows = []
    bw = copy_bandwidth()
    rows.append(dict(copy_bw=bw))
    for total_rows in (8 * 131072, 32 * 32768):
        n_tiles = total_rows // 64
        bufs = [torch.randint(-2**31, 2**31 - 1, (total_rows, RW), dtype=torch.int32, device=dev) for _ in range(2)]
        for ctas_per_sm in (1, 2):
            grid = sms * ctas_per_sm
            n_per = n_tiles // grid
            nbytes = grid * n_per * 64 * 640
            out = torch.empty(grid, dtype=torch.int32, device=dev)
            variants = [(f"cp_S{S}", lambda b, S=S: stream_cp[(grid,)](b, out, n_per, RW=RW, S=S, num_warps=4))
                        for S in (1, 2, 3, 4, 5) if S * 40 * ctas_per_sm <= 220]
            variants.append(("reg_ahead1", lambda b: stream_reg[(grid,)](b, out, n_per, RW=RW, num_warps=4)))
            for name, fn in variants:
                try:
                    i = [0]
                    def call():
                        fn(bufs[i[0] % 2]); i[0] += 1
                    call(); torch.cuda.synchronize()
                    ms = bench(call)
                    rec = dict(rows=total_rows, ctas_per_sm=ctas_per_sm, variant=name, ms=ms,
                               bw_frac=nbytes / (ms * 1e-3) / bw)
                except Exception as e:  # noqa: BLE001
                    rec = dict(rows=total_rows, ctas_per_sm=ctas_per_sm, variant=name, err=f"{type(e).__name__}: {e}"[:300])
                print(json.dumps(rec), flush=True)
                rows.append(rec)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "stream_fp8.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
