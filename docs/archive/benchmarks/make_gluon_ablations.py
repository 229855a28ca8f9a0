"""Variants of the Gluon kernel's source that leave one stage of a tile out or move it, for
placing the time inside the kernel without hardware counters (H200.md: "time variants that
leave one stage out ... and take differences"), and the tries that moved or added a stage
(docs/kernel_notes.md v12). The "left out" variants compute wrong results on purpose; all
exist to be timed beside the kernel by ``probe_gluon_configs.py --baseline``.

    python benchmarks/make_gluon_ablations.py --out-dir /tmp/abl [--only no_pv,q_first]
    python benchmarks/probe_gluon_configs.py --configs 64,64,2,6 \
        --baseline $(ls /tmp/abl/*.py | paste -sd,) --out x.json

Each variant is a text edit of this checkout's ``mla_gluon.py`` that must match exactly once
(a moved anchor fails here, not silently on the device).
"""
from __future__ import annotations

import argparse
import os

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dcp_pass", "runtime", "decode", "kernels",
                   "mla_gluon.py")

# the tile body of schedule 6 (the default on Triton 3.6): its lines that the variants edit
SCORE = "    s = _score_tile(cur_lat, cur_rope, q_lat_s, q_rope_s, q_reg, BLOCK_H, BLOCK_N, Q_REG, DL, s_mma)\n"
COPIES = ("    _issue_copies(nxt_lat, nxt_rope, t1, end, kv_row, kt_row, skv_t, skt_t, n_lat, c_lat, n_rope, c_rope)\n")
WAIT_S = "    s = warpgroup_mma_wait(0, deps=[s])\n"
PROBS = "        p, alpha, m_new = _probs(s, m_i, start + it * BLOCK_N, end, cols_s, sm_scale_log2, red_s)\n"
RESCALE = "    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]\n    acc = warpgroup_mma("
PV = "    acc = warpgroup_mma(p_s, cur_lat, acc)\n    return acc, m_new, l_2d\n"
P_STORE = "    p_s.store(p.to(p_s.dtype))\n    fence_async_shared()\n    _barrier()\n    acc = acc *"
# the kernel's line after its prologue copies, before the tile loop's state
LOOP_START = "    m_i = gl.full([BLOCK_H], float(\"-inf\")"
# the kernel's first line after its layouts: where q starts to load
QUERIES = "    # ---- queries: loaded once"

HALF_COPIES = '''

def _issue_lat_half_src(lat_buf, t0, end, kv_row, skv_t, n_lat, c0: gl.constexpr):
    """(ablation copy_split) columns c0 .. c0 + 255 of the tile's latent rows, one commit group."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    n = gl.convert_layout(n_lat, gl.SliceLayout(1, ld))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, ld))
    _async_load(lat_buf.slice(c0, 256, dim=1), kv_row + (t0 + n).to(gl.int64)[:, None] * skv_t + (c0 + c)[None, :],
                mask=((t0 + n) < end)[:, None])
    cp.commit_group()


def _issue_rope_src(rope_buf, t0, end, kt_row, skt_t, n_rope, c_rope):
    _async_load(rope_buf, kt_row + (t0 + n_rope).to(gl.int64)[:, None] * skt_t + c_rope[None, :],
                mask=((t0 + n_rope) < end)[:, None])
    cp.commit_group()


def _pair_tile_src('''

LAZY_PROBS = '''def _probs_src(s, m_i, t0, end, cols_s, sm_scale_log2, red_s):
    """(ablation rescale_lazy) the running max moves only when a row's tile max passes it by
    more than 8 (p <= 2^8), and acc is rescaled only when some row's max moved."""
    s = gl.where(((t0 + cols_s) < end)[None, :], s, float("-inf"))
    m_cand = gl.maximum(m_i, _row_max(s, red_s) * sm_scale_log2)
    m_new = gl.where(m_cand > m_i + 8.0, m_cand, m_i)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * sm_scale_log2 - m_use[:, None])
    return p, gl.exp2(m_i - m_use), m_new
'''


PREFETCH = '''

def _prefetch_l2_src(kv_row, kt_row, t0, end, skv_t, skt_t, BLOCK_N: gl.constexpr):
    """(candidate l2_prefetch) an L2 prefetch of the tile at key t0, no shared memory: each
    thread one bulk prefetch of a quarter of a latent row (256 B), the first BLOCK_N threads
    one of a rope row (128 B); keys past `end` skipped."""
    pf: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    i = gl.arange(0, 4 * BLOCK_N, layout=pf)
    row = t0 + i // 4
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 256; mov.u32 $0, 0; }",
        "=r,l,r", [kv_row + row.to(gl.int64) * skv_t + (i % 4) * 128, (row < end).to(gl.int32)],
        dtype=gl.int32, is_pure=False, pack=1)
    r2 = t0 + i
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 128; mov.u32 $0, 0; }",
        "=r,l,r", [kt_row + r2.to(gl.int64) * skt_t, ((i < BLOCK_N) & (r2 < end)).to(gl.int32)],
        dtype=gl.int32, is_pure=False, pack=1)


def _prefetch_l2_warps_src(kv_row, kt_row, t0, end, skv_t, skt_t, BLOCK_N: gl.constexpr):
    """(candidate l2_prefetch_warps) one bulk L2 prefetch per warp, with a warp-uniform address
    (a per-thread address makes ptxas loop over the lanes: the bulk prefetch is a uniform-
    datapath instruction): warp w prefetches key rows [t0 + 8 w, t0 + 8 w + 8) as one
    contiguous range of 8 row strides (the fused cache's rows, rope included); rows past
    `end` skipped."""
    wl: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[], lane_bases=[[0], [0], [0], [0], [0]],
                                                  warp_bases=[[1], [2], [4]], block_bases=[], shape=[8])
    w = gl.arange(0, 8, layout=wl)
    row = t0 + w * (BLOCK_N // 8)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [kv_row + row.to(gl.int64) * skv_t, ((row + BLOCK_N // 8) <= end).to(gl.int32),
                     gl.full([8], 0, gl.int32, layout=wl) + skv_t * (2 * BLOCK_N // 8)],
        dtype=gl.int32, is_pure=False, pack=1)


def _prefetch_l2_rows_src(kv_row, kt_row, t0, end, skv_t, skt_t, BLOCK_N: gl.constexpr):
    """(candidate l2_prefetch_rows) as _prefetch_l2_src with one thread per key row: a 1 KB
    bulk prefetch of its latent part and a 128 B one of its rope part."""
    pf: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    i = gl.arange(0, 256, layout=pf)
    row = t0 + i
    on = ((i < BLOCK_N) & (row < end)).to(gl.int32)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 1024; mov.u32 $0, 0; }",
        "=r,l,r", [kv_row + row.to(gl.int64) * skv_t, on], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 128; mov.u32 $0, 0; }",
        "=r,l,r", [kt_row + row.to(gl.int64) * skt_t, on], dtype=gl.int32, is_pure=False, pack=1)


def _pair_tile_src('''


def l2_prefetch(text, ahead, fn="_prefetch_l2"):
    """Tile it + 1 + ahead prefetched into L2 when tile it + 1's copies are issued (the
    prologue prefetches tiles 1 .. ahead): HBM reads run ahead of the two-buffer ring."""
    text = _once(text, "\n\ndef _pair_tile_src(", PREFETCH)
    text = _once(text, "    _pair_tile = gluon.jit(_pair_tile_src)\n",
                 "    _pair_tile = gluon.jit(_pair_tile_src)\n    _prefetch_l2 = gluon.jit(_prefetch_l2_src)\n"
                 "    _prefetch_l2_rows = gluon.jit(_prefetch_l2_rows_src)\n"
                 "    _prefetch_l2_warps = gluon.jit(_prefetch_l2_warps_src)\n")
    text = _pair_edit(text, COPIES, COPIES + f"    {fn}(kv_row, kt_row, t1 + {ahead} * BLOCK_N, end, skv_t, skt_t, "
                                            "BLOCK_N)\n")
    pro = "".join(f"    {fn}(kv_row, kt_row, start + {k} * BLOCK_N, end, skv_t, skt_t, BLOCK_N)\n"
                  for k in range(1, ahead + 1))
    return _once(text, LOOP_START, pro + LOOP_START)


def stagger(text, groups, ns):
    """Programs of split pid_sp start (pid_sp % groups) * ns nanoseconds late, so that their
    tile loads alternate with the others' instead of all 128 arriving at once (a test of
    whether the lock-step of the programs leaves the memory idle between tiles)."""
    sleep = (f"    _dl: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])\n"
             f"    gl.inline_asm_elementwise(\"nanosleep.u32 $1; mov.u32 $0, 0;\", \"=r,r\", "
             f"[gl.full([256], 0, gl.int32, layout=_dl) + (pid_sp % {groups}) * {ns}], dtype=gl.int32, "
             f"is_pure=False, pack=1)\n")
    return _once(text, QUERIES, sleep + QUERIES)


def _once(text, old, new):
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"anchor found {n} times, not once: {old[:80]!r}")
    return text.replace(old, new)


def _pair_edit(text, old, new):
    """Edit inside _pair_tile_src only (the schedule 1-3 loop has lines like it)."""
    i = text.index("def _pair_tile_src(")
    j = text.index("def _mla_gluon_kernel_src(")
    return text[:i] + _once(text[i:j], old, new) + text[j:]


def q_first(text):
    """The first tile's copies issued before q is loaded (they no longer wait behind it)."""
    a = text.index(QUERIES)
    b = text.index("    if SCHEDULE == 6:\n        k_lat_a = gl.allocate_shared_memory")
    queries = text[a:b]
    text = text[:a] + text[b:]
    return _once(text, LOOP_START, queries + LOOP_START)


_EVICT_LAT = """                mask=((t0 + n_lat) < end)[:, None])
    _async_load(rope_buf"""
_EVICT_ROPE = """                mask=((t0 + n_rope) < end)[:, None])
    cp.commit_group()"""


def kv_evict_first(text):
    """The cache copies with eviction_policy="evict_first" (Triton 3.6's Gluon drops the hint:
    the PTX has no cache_hint, so this times the same code; kept to show that)."""
    text = _once(text, _EVICT_LAT, _EVICT_LAT.replace("[:, None])", "[:, None], eviction_policy=\"evict_first\")"))
    return _once(text, _EVICT_ROPE, _EVICT_ROPE.replace("[:, None])", "[:, None], eviction_policy=\"evict_first\")"))


def copy_split(text):
    """Half of the next tile's latent columns (and its rope) issued before the score wait, the
    other half after it."""
    text = _once(text, "\n\ndef _pair_tile_src(", HALF_COPIES)
    text = _once(text, "    _pair_tile = gluon.jit(_pair_tile_src)\n",
                 "    _pair_tile = gluon.jit(_pair_tile_src)\n    _issue_lat_half = gluon.jit(_issue_lat_half_src)\n"
                 "    _issue_rope = gluon.jit(_issue_rope_src)\n")
    return _pair_edit(text, COPIES + WAIT_S,
                      "    _issue_lat_half(nxt_lat, t1, end, kv_row, skv_t, n_lat, 0)\n"
                      "    _issue_rope(nxt_rope, t1, end, kt_row, skt_t, n_rope, c_rope)\n" + WAIT_S +
                      "    _issue_lat_half(nxt_lat, t1, end, kv_row, skv_t, n_lat, 256)\n")


def rescale_lazy(text):
    """FA4-style lazy rescale: the running max moves only past a margin of 2^8, and the
    accumulator is rescaled only when some row's max moved (one block-wide decision)."""
    text = _once(text, text[text.index("def _probs_src("):text.index("def _probs_masked_src(")], LAZY_PROBS + "\n\n")
    return _pair_edit(text, RESCALE, "    if gl.max(gl.where(m_new > m_i, 1, 0), axis=0) > 0:\n"
                                     "        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]\n"
                                     "    acc = warpgroup_mma(")


# the score GEMM's latent part as issued by the kernel: the register columns, then the rest
SCORE_LATENT = """    if Q_REG > 0:
        s = warpgroup_mma(q_reg, cur_lat.slice(0, Q_REG, dim=1).permute((1, 0)), s, is_async=True)
        if Q_REG < DL // 2:  # shared-memory slices must be powers of two wide
            s = warpgroup_mma(q_lat_s.slice(Q_REG, DL // 2 - Q_REG, dim=1),
                              cur_lat.slice(Q_REG, DL // 2 - Q_REG, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_lat_s.slice(DL // 2, DL // 2, dim=1),
                          cur_lat.slice(DL // 2, DL // 2, dim=1).permute((1, 0)), s, is_async=True)
"""
Q_REG_LOAD = ("        q_reg = q_lat_s.slice(0, Q_REG, dim=1).load(gl.DotOperandLayout(operand_index=0, parent=s_mma, "
              "k_width=2))\n")


def score_interleave(text, width, smem_first=False):
    """(candidate score_interleave) with q_reg 256, the score GEMM's register-operand steps
    alternate with its shared-memory-operand steps in pieces of `width` columns, instead of
    16 register steps then 16 shared-memory ones. In lock-step both warpgroups issue the same
    step: a shared-memory step reads q (2 KB) and the keys (1 KB) per warpgroup for 16
    cycles of tensor work (smem-bound, ~24 cycles), a register step only the keys (tensor
    bound); alternating lets the two kinds overlap in the tensor pipe."""
    n = 256 // width
    loads = "".join(f"q_lat_s.slice({j * width}, {width}, dim=1).load(_q_op), " for j in range(n))
    text = _once(text, Q_REG_LOAD,
                 "        _q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2)\n"
                 f"        q_reg = ({loads})\n")
    steps = []
    for j in range(n):
        reg = (f"        s = warpgroup_mma(q_reg[{j}], cur_lat.slice({j * width}, {width}, dim=1).permute((1, 0)), s, "
               "is_async=True)\n")
        hi = 256 + j * width
        sm = (f"        s = warpgroup_mma(q_lat_s.slice({hi}, {width}, dim=1), cur_lat.slice({hi}, {width}, "
              "dim=1).permute((1, 0)), s, is_async=True)\n")
        steps.append(sm + reg if smem_first else reg + sm)
    return _once(text, SCORE_LATENT, "    if Q_REG > 0:\n" + "".join(steps))


VARIANTS = {
    # a stage left out: wrong results on purpose, to place its time
    "no_copies": lambda t: _pair_edit(t, COPIES, ""),
    "no_score": lambda t: _pair_edit(
        _pair_edit(t, SCORE, "    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_mma)\n"), WAIT_S, ""),
    "no_softmax": lambda t: _pair_edit(t, PROBS, "        p, alpha, m_new = s, gl.full([BLOCK_H], 1.0, gl.float32, "
                                                  "layout=gl.SliceLayout(1, s_mma)), m_i\n"),
    "no_p_store": lambda t: _pair_edit(t, P_STORE, "    acc = acc *"),
    "no_rescale": lambda t: _pair_edit(t, RESCALE, "    acc = warpgroup_mma("),
    "no_pv": lambda t: _pair_edit(t, PV, "    return acc, m_new, l_2d\n"),
    # the same copies, always of the split's first tile (L2-resident after the first): wrong
    # results; the copies' instructions and shared-memory writes without the trip from HBM
    "copies_from_l2": lambda t: _pair_edit(t, "    t1 = start + (it + 1) * BLOCK_N\n", "    t1 = start\n"),
    # a stage moved or added: exact
    "q_first": q_first,
    "copy_late": lambda t: _pair_edit(_pair_edit(t, COPIES, ""), WAIT_S, WAIT_S + COPIES),
    "copy_split": copy_split,
    "rescale_lazy": rescale_lazy,
    "kv_evict_first": kv_evict_first,
    "l2_prefetch_1": lambda t: l2_prefetch(t, 1),
    "l2_prefetch_2": lambda t: l2_prefetch(t, 2),
    "l2_prefetch_3": lambda t: l2_prefetch(t, 3),
    "l2_prefetch_rows_1": lambda t: l2_prefetch(t, 1, "_prefetch_l2_rows"),
    "l2_prefetch_rows_2": lambda t: l2_prefetch(t, 2, "_prefetch_l2_rows"),
    "l2_prefetch_warps_1": lambda t: l2_prefetch(t, 1, "_prefetch_l2_warps"),
    "l2_prefetch_warps_2": lambda t: l2_prefetch(t, 2, "_prefetch_l2_warps"),
    "l2_prefetch_warps_3": lambda t: l2_prefetch(t, 3, "_prefetch_l2_warps"),
    "q_first_l2_prefetch_2": lambda t: l2_prefetch(q_first(t), 2),
    "stagger2_1000": lambda t: stagger(t, 2, 1000),
    "stagger2_1500": lambda t: stagger(t, 2, 1500),
    "stagger4_700": lambda t: stagger(t, 4, 700),
    "stagger8_350": lambda t: stagger(t, 8, 350),
    "score_interleave_32": lambda t: score_interleave(t, 32),
    "score_interleave_64": lambda t: score_interleave(t, 64),
    "score_interleave_128": lambda t: score_interleave(t, 128),
    "score_interleave_64_smem_first": lambda t: score_interleave(t, 64, smem_first=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    a = ap.parse_args()
    with open(SRC) as f:
        text = f.read()
    os.makedirs(a.out_dir, exist_ok=True)
    for name in (a.only.split(",") if a.only else VARIANTS):
        with open(os.path.join(a.out_dir, f"{name}.py"), "w") as f:
            f.write(VARIANTS[name](text))
        print(os.path.join(a.out_dir, f"{name}.py"))


if __name__ == "__main__":
    main()
