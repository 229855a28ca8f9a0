#!/usr/bin/env bash
# Issue 6: the DCP scaling table on one 4- or 8-GPU H200 machine, in one device call.
#   bash benchmarks/run_scaling.sh            # uses every visible GPU
# Writes under ${OUT:-benchmarks/results/scaling}: kernel sweep/tuning, the layer table
# (TP = world, DCP = 1, 2, 4[, 8], comm a2a_rq / a2a_gq / ag_rs, eager + CUDA graphs),
# a plot, and a log. Total run time is kept under ~9 minutes.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/scaling}
mkdir -p "$OUT"
if [ "${DRY:-0}" = 1 ]; then
  # CPU rehearsal of the same table logic (gloo ranks, small dims, reference kernel, checked
  # against a single-process reference): DRY=1 W=8 bash benchmarks/run_scaling.sh
  W=${W:-4}
  case "$W" in 8) DCP=1,2,4,8 ;; 4) DCP=1,2,4 ;; *) DCP=1,2 ;; esac
  python3 benchmarks/bench_layer.py --check --device cpu --world "$W" --tp "$W" --dcp "$DCP" \
    --ctx 7,45 --batch 1,3 --out "$OUT/layer_scaling_dry.json"
  exit $?
fi
W=$(python3 -c "import torch; print(torch.cuda.device_count())")
case "$W" in
  8) DCP=1,2,4,8 ;;
  4) DCP=1,2,4 ;;
  2) DCP=1,2 ;;
  *) echo "need 2, 4 or 8 GPUs, found $W"; exit 2 ;;
esac
echo "world=$W dcp=$DCP" | tee "$OUT/scaling.log"
nvidia-smi topo -m >> "$OUT/scaling.log" 2>&1 || true
# 1. kernel configs for this GPU (short sweep; ~2 min), used by the layer benchmark
TUNED=benchmarks/results/tuned_h200.json
timeout 200 python3 benchmarks/bench_kernel.py --sweep --no-table --out "$OUT/kernel_sweep.json" \
  --tuned-out "$OUT/tuned.json" >> "$OUT/scaling.log" 2>&1 && TUNED="$OUT/tuned.json"
# 2. the scaling table: TP = world, every DCP size dividing it
timeout 330 python3 benchmarks/bench_layer.py --world "$W" --tp "$W" --dcp "$DCP" \
  --ctx 32768,131072,524288,1048576 --batch 1,8,32 --comm a2a_rq,a2a_gq,ag_rs --modes eager,graph \
  --iters 10 --tuned "$TUNED" --out "$OUT/layer_scaling.json" --timeout 320 2>&1 | tee -a "$OUT/scaling.log" | tail -80
python3 benchmarks/plot_layer.py "$OUT/layer_scaling.json" "$OUT/layer_scaling.png" >> "$OUT/scaling.log" 2>&1 || true
