#!/usr/bin/env bash
# FlashInfer on the H200 machine: install the vendored wheel offline,
# JIT-build its MLA decode kernels with the machine's nvcc, check them and our
# attn_backend="flashinfer" against float64 references, time them. Run from the repo root
# with vendor/flashinfer carried (fill it here first: bash benchmarks/vendor_flashinfer.sh):
#
#   run(command="bash benchmarks/flashinfer_probe.sh", carry=["vendor/flashinfer"], timeout_s=480)
#
# Writes $OUT/flashinfer_probe.json (always: on any failure it says which step and why)
# and $OUT/flashinfer_probe.log (install, nvcc/ninja output, tracebacks). Wall time: about
# 7 minutes at most (PROBE_BUDGET seconds for the Python stages, default 370).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/flashinfer_probe_out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
LOG="$OUT/flashinfer_probe.log"
JSON="$OUT/flashinfer_probe.json"
: > "$LOG"

fail_json() {  # $1: step, $2: message (the log's tail is attached)
    python3 - "$1" "$2" "$LOG" "$JSON" <<'EOF'
import json, sys
step, msg, log, out = sys.argv[1:5]
try:
    tail = open(log, errors="replace").read()[-12000:]
except OSError:
    tail = ""
json.dump({"verdict": f"failed at {step}", "error": msg, "log_tail": tail}, open(out, "w"), indent=1)
EOF
}

{
    echo "== $(date -u +%FT%TZ) flashinfer probe"
    ls -la vendor/flashinfer 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | head -3
    command -v nvcc || ls /usr/local/cuda/bin/nvcc
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
} >> "$LOG" 2>&1

if ! ls vendor/flashinfer/flashinfer_python-*.whl >/dev/null 2>&1; then
    fail_json install "vendor/flashinfer has no flashinfer wheel: carry vendor/flashinfer (bash benchmarks/vendor_flashinfer.sh fills it)"
    exit 1
fi
# shellcheck source=benchmarks/flashinfer_env.sh
source benchmarks/flashinfer_env.sh >> "$LOG" 2>&1
echo "PYTHONPATH=$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$FLASHINFER_WORKSPACE_BASE ninja=$(command -v ninja)" >> "$LOG"
if ! python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)" >> "$LOG" 2>&1; then
    fail_json import "flashinfer does not import after the offline install (see log_tail)"
    exit 1
fi

timeout -k 10 "$(( ${PROBE_BUDGET:-370} + 30 ))" python3 benchmarks/flashinfer_probe.py \
    --budget "${PROBE_BUDGET:-370}" ${PROBE_ARGS:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ ! -s "$JSON" ]; then
    fail_json probe "benchmarks/flashinfer_probe.py exited with $rc before writing its JSON (124: timeout)"
elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    python3 - "$JSON" <<'EOF'
import json, sys
p = sys.argv[1]
d = json.load(open(p))
d["verdict"] = "timed out after the stages recorded here"
json.dump(d, open(p, "w"), indent=1)
EOF
fi
# the build files of the JIT kernels (small): what nvcc was asked to do
find "${FLASHINFER_WORKSPACE_BASE}" -name build.ninja 2>/dev/null | while read -r f; do
    cp "$f" "$OUT/$(basename "$(dirname "$f")").build.ninja"
done
echo "== done rc=$rc" >> "$LOG"
exit "$rc"
