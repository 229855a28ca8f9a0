"""Write dcp_pass/runtime/decode/kernels/path_table.py from measured kernel timings.

Sources (H200, committed under benchmarks/results/):
* kernel_paths_h200.json   every kernel "auto" chooses from, timed side by side in one run
  (benchmarks/bench_flashinfer_kernel.py): the split, two-GEMM and Gluon kernels, and
  FlashInfer through its adapter in a captured decode step (planned from the step's count,
  plus its measured per-step planning cost, plan_ms_per_call),
  16/64/128 heads, B 8/32, 4K-128K keys. It is the whole plain-call table.
* fp8_paths_h200.json, fp8_narrow_h200.json  the kernels that read an fp8 latent cache, timed
  on packed fp8 rows (benchmarks/bench_fp8.py --reads "" --kernels split,wide,gluon_fp8[,
  gluon_fp8_narrow]): their own keys (split_fp8, wide_fp8, gluon_fp8, gluon_fp8_narrow), which
  the chooser compares for fp8 calls only; a later run's timing replaces an earlier one's.
* masked_paths_int32_h200.json, masked_paths_16h_h200.json, masked_paths_roles_h200.json,
  masked_paths_fp8_h200.json, masked_paths_fp8_narrow_h200.json  what a decode step's mask
  row or a causal cap costs each path
  (benchmarks/probe_masked_paths.py), per query rows; a later file's figure replaces an
  earlier one's for the same call, path and rows (the role-split kernel's masked calls
  replace the lock-step kernel's under the shared "gluon" key: it runs them now)

    python benchmarks/make_path_table.py   # rewrites the MEASURED and CALL_COST blocks; commit them with the JSONs
"""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "dcp_pass", "runtime", "decode", "kernels", "path_table.py")
PATHS_RUN = "kernel_paths_h200.json"
# the run's column of each path; FlashInfer as the pass runs it (the adapter, captured), else its bare kernel
COLUMNS = {"split": ("split_ms",), "wide": ("wide_ms",), "gluon": ("gluon_ms",), "seesaw": ("gluon_seesaw_ms",),
           "flashinfer": ("fi_step_ms", "fi_page_T_ms")}
# runs of bench_fp8.py; a later run's timing of a kernel at a shape replaces an earlier one's
FP8_RUNS = ("fp8_paths_h200.json", "fp8_narrow_h200.json")
# bench_fp8.py's kernel column (the kernel asked for and the one that ran) -> the fp8 cost key
FP8_KERNELS = {"split (split)": "split_fp8", "wide (wide)": "wide_fp8", "gluon_fp8 (gluon_fp8)": "gluon_fp8",
               "gluon_fp8_narrow (gluon_fp8_narrow)": "gluon_fp8_narrow"}


STEP_RUN = "model_fast_path_flashinfer_h200.json"


def plan_ms_per_call() -> dict:
    """Each host-planned path's plan cost per attention call, added to its kernel time: its
    captured decode step's time over the Triton kernels' step, spread over the step's layers.
    Measured on the 4-layer V3-sized fast path (128 heads, B=32, 32K keys; STEP_RUN): 5.08 vs
    4.36 ms with the kernels within 0.02 ms a call of each other (FlashInfer's plan waits for
    the last plan's copy, so the host no longer runs ahead of the GPU): 0.18 ms a call."""
    run = json.load(open(os.path.join(HERE, "results", STEP_RUN)))
    step = {r.get("fast_path_options", {}).get("attn_backend"): r["step_ms_median"] for r in run["rows"]}
    return {"flashinfer": round((step["flashinfer"] - step["triton"]) / run["cfg"]["model"]["n_layers"], 3)}


def rows() -> list[tuple]:
    table, plan_ms = {}, plan_ms_per_call()
    for r in json.load(open(os.path.join(HERE, "results", PATHS_RUN)))["rows"]:
        timings = table.setdefault((r["H"], r["B"], r["T"]), {})
        for path, keys in COLUMNS.items():
            ms = next((r[k] for k in keys if r.get(k)), None)
            if ms:
                timings[path] = round(ms + plan_ms.get(path, 0.0), 4)
    for name in FP8_RUNS:
        for r in json.load(open(os.path.join(HERE, "results", name)))["rows"]:
            key = FP8_KERNELS.get(r["kernel"])
            if r["dtype"] == "fp8_e4m3" and key and r.get("ms"):
                table.setdefault((r["H"], r["B"], r["T"]), {})[key] = round(r["ms"], 4)
    return sorted((h, b, t, ms) for (h, b, t), ms in table.items() if ms)


MASKED_RUNS = ("masked_paths_int32_h200.json", "masked_paths_16h_h200.json", "masked_paths_roles_h200.json",
               "masked_paths_fp8_h200.json", "masked_paths_fp8_narrow_h200.json")
# a probe row's path (a registry kernel, or "gluon": the default config's) -> its cost key, per
# cache; None: not a key of its own (the lock-step kernel shares "gluon" with the role-split
# kernel, which takes its calls where both can run)
PROBE_KEYS = {"bf16": {"split": "split", "wide": "wide", "gluon": "gluon", "gluon_roles": "gluon",
                       "gluon_seesaw": "seesaw", "gluon_lock_step": None},
              "fp8_e4m3": {"split": "split_fp8", "wide": "wide_fp8", "gluon_fp8": "gluon_fp8",
                           "gluon_fp8_narrow": "gluon_fp8_narrow"}}
KINDS = ("mask", "causal")  # (a call with both is a "causal" call: CallShape.kind)


def call_costs() -> list[tuple]:
    """(call, path, query rows, time over the plain call's), "mask" and "causal" calls: the
    median over the shapes measured at those rows, the last file's where several have them."""
    costs: dict[tuple, float] = {}
    for name in MASKED_RUNS:
        path = os.path.join(HERE, "results", name)
        if not os.path.exists(path):
            continue
        ratios: dict[tuple, list] = {}
        for r in json.load(open(path))["rows"]:
            key = PROBE_KEYS[r.get("cache", "bf16")].get(r["path"])
            if r["call"] in KINDS and key and r.get("vs_plain"):
                ratios.setdefault((r["call"], key, r["H"]), []).append(r["vs_plain"])
        costs.update({k: round(sorted(v)[len(v) // 2], 3) for k, v in ratios.items()})
    return sorted((call, key, h, f) for (call, key, h), f in costs.items())


def _replace_block(text: str, name: str, body: str) -> str:
    head, rest = text.split(f"{name} = (\n", 1)
    tail = ("\n" + rest).split("\n)\n", 1)[1]
    return f"{head}{name} = (\n{body}\n)\n{tail}"


def main():
    """Rewrite only the generated blocks of path_table.py; its docstring and `fastest` are hand-written."""
    table, costs = rows(), call_costs()
    with open(OUT) as f:
        text = f.read()
    measured = "\n".join(f"    ({h}, {b}, {t}, {json.dumps(ms)})," for h, b, t, ms in table)
    text = _replace_block(text, "MEASURED", measured)
    text = _replace_block(text, "CALL_COST", "\n".join(f"    {c!r}," for c in costs))
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}: {len(table)} shapes, {len(costs)} call costs")


if __name__ == "__main__":
    main()
