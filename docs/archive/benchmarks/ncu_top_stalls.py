"""Where a kernel's warps stall, from Nsight Compute's per-instruction source page:

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
    python ncu_top_stalls.py src.csv

Prints the stall samples by opcode, the 40 instructions with most samples, and, for each of the
three execution counts that cover most samples (in a warp-specialised kernel each partition's
loop body has its own count: the narrow fp8 kernel's loader runs its loop once a tile a warp,
each scorer once for each of its tiles), that group's share of samples, its stall reasons and
its opcode mix (instructions a pass through the loop). Used for
results/fp8_narrow_b32_128k_profile_h200.txt (2026-12-04, second stop)."""
import collections
import csv
import sys


def num(x):
    try:
        return float(x or 0)
    except ValueError:
        return 0.0


def opcode(sass):
    toks = sass.split()
    op = toks[1] if toks and toks[0].startswith("@") and len(toks) > 1 else (toks[0] if toks else "?")
    return op.split(".")[0]


def main(path):
    rows = list(csv.reader(open(path)))
    at = next(i for i, r in enumerate(rows) if "Source" in r)
    hdr, data = rows[at], rows[at + 1:]
    samples, src, execd = (hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source"),
                           hdr.index("Instructions Executed"))
    reasons = [i for i, c in enumerate(hdr) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(num(r[samples]) for r in data)
    print(f"samples {total:.0f}")
    by_op = collections.Counter()
    for r in data:
        by_op[opcode(r[src])] += num(r[samples])
    print("by opcode:", ", ".join(f"{op} {v / total:.3f}" for op, v in by_op.most_common(20)))
    print("top instructions (share of samples | SASS):")
    for r in sorted(data, key=lambda r: -num(r[samples]))[:40]:
        print(f"  {num(r[samples]) / total:6.3f} | {r[src][:90]}")
    groups = collections.defaultdict(list)
    for r in data:
        groups[r[execd]].append(r)
    for count, rs in sorted(groups.items(), key=lambda kv: -sum(num(r[samples]) for r in kv[1]))[:3]:
        share = sum(num(r[samples]) for r in rs) / total
        why = collections.Counter()
        for r in rs:
            for i in reasons:
                why[hdr[i]] += num(r[i])
        n = sum(why.values()) or 1
        mix = collections.Counter(opcode(r[src]) for r in rs)
        print(f"lines executed {count} times: {len(rs)} instructions, {share:.3f} of samples")
        print("  stall reasons:", ", ".join(f"{k[6:]} {v / n:.3f}" for k, v in why.most_common(10)))
        print("  opcodes:", ", ".join(f"{k} {v}" for k, v in mix.most_common(16)))


if __name__ == "__main__":
    main(sys.argv[1])
