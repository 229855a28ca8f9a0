#!/usr/bin/env bash
# The DCP scaling tables on one 4- or 8-GPU H200 machine, one device call each.
#   bash benchmarks/run_scaling.sh              # layer table, every visible GPU
#   PART=model bash benchmarks/run_scaling.sh   # whole-model table
# Writes under ${OUT:-benchmarks/results/scaling}: the layer table (TP = world,
# DCP = 1, 2, 4[, 8], comm a2a_rq / a2a_gq / ag_rs, eager + CUDA graphs) and its plot, or
# the model table (DCP sizes x 128K / 512K tokens, CUDA graphs), and a log. Each part
# stays under ~9 minutes; SWEEP=1 adds a kernel re-tune (~2 min) before the layer table.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/scaling}
mkdir -p "$OUT"
PART=${PART:-layer}
if [ "${DRY:-0}" = 1 ]; then
  # CPU rehearsal of the same logic (gloo ranks, small dims, reference kernel):
  #   DRY=1 W=8 bash benchmarks/run_scaling.sh             layer, vs a single-process reference
  #   DRY=1 W=8 PART=model bash benchmarks/run_scaling.sh  whole model, tokens vs DCP=1
  W=${W:-4}
  case "$W" in 8) DCP=1,2,4,8 ;; 4) DCP=1,2,4 ;; *) DCP=1,2 ;; esac
  if [ "$PART" = model ]; then
    python3 benchmarks/bench_model.py --device cpu --model small --world "$W" --dcp "$DCP" --ctx 45 \
      --steps 2 --warmup 1 --batch 3 --timeout 1500 --out "$OUT/model_scaling_dry.json"
  else
    python3 benchmarks/bench_layer.py --check --device cpu --world "$W" --tp "$W" --dcp "$DCP" \
      --ctx 7,45 --batch 1,3 --out "$OUT/layer_scaling_dry.json"
  fi
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
if [ "$PART" = model ]; then
  # the DeepSeek-V3-sized 4-layer stack through the compile pass, TP = world, CUDA graphs
  # (one device call of its own: ~40 s per variant)
  timeout 560 python3 benchmarks/bench_model.py --world "$W" --dcp "$DCP" --ctx 131072,524288 --batch 8 \
    --modes reduce-overhead --steps 16 --warmup 4 --timeout 550 --out "$OUT/model_scaling.json" 2>&1 \
    | tee -a "$OUT/scaling.log" | grep "^|"
  exit 0
fi
# 1. kernel configs: the committed H200 defaults; SWEEP=1 re-tunes first (~2 min more)
TUNED=benchmarks/results/tuned_h200.json
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/bench_kernel.py --sweep --no-table --out "$OUT/kernel_sweep.json" \
    --tuned-out "$OUT/tuned.json" >> "$OUT/scaling.log" 2>&1 && TUNED="$OUT/tuned.json"
fi
# 2. the scaling table: TP = world, every DCP size dividing it
timeout 330 python3 benchmarks/bench_layer.py --world "$W" --tp "$W" --dcp "$DCP" \
  --ctx 32768,131072,524288,1048576 --batch 1,8,32 --comm a2a_rq,a2a_gq,ag_rs --modes eager,graph \
  --iters 10 --tuned "$TUNED" --out "$OUT/layer_scaling.json" --timeout 320 2>&1 | tee -a "$OUT/scaling.log" | tail -80
python3 benchmarks/plot_layer.py "$OUT/layer_scaling.json" "$OUT/layer_scaling.png" >> "$OUT/scaling.log" 2>&1 || true
