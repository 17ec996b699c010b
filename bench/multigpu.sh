#!/usr/bin/env bash
# Ours against hand-written PyTorch on 1, 2, 4 and 8 GPUs of this machine: the LLaMA-3-8B-shaped block's
# forward (FP16) on the five token workloads and the matrix chains A-E, then the block's training step
# (bench/gpu_train.py's: bf16 activations, float32 masters, MSE, AdamW) on 8K, 4x2K and 32x1K against
# PyTorch DDP and FSDP2.  Writes bench/results/multigpu/:
#   topo.txt (nvidia-smi topo -m), topology.json + topology.raw.json (measured), ours.json,
#   baselines_n<N>.json, ours_train.json, baselines_train_n<N>.json, multigpu.json / .md / .png (merged).
#
#   bash bench/multigpu.sh            # everything (GPU counts above the visible GPUs are skipped)
#   bash bench/multigpu.sh --quick    # 1K and 8x1K, chains B and C; the training step on 4x2K
# Environment: GPUS="1 2 4 8" to choose counts, CHECK=0 to skip the baselines' correctness checks,
# TRAIN=0 to skip the training step, OUT=<folder> to write elsewhere, OURS_ARGS / TRAIN_ARGS /
# BASELINE_ARGS / TRAIN_BASELINE_ARGS for extra arguments to bench/multigpu.py ours / bench/multigpu.py
# train / bench/baselines/run.py / bench/baselines/run.py --train (e.g. BASELINE_ARGS="--rounds 20").
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-bench/results/multigpu}
WORKLOADS=1K,8K,8x1K,128x1K,128K
CHAINS=A,B,C,D,E
TRAIN_WORKLOADS=8K,4x2K,32x1K
if [[ "${1:-}" == "--quick" ]]; then WORKLOADS=1K,8x1K; CHAINS=B,C; TRAIN_WORKLOADS=4x2K; fi
CHECK_FLAG=--check
if [[ "${CHECK:-1}" == "0" ]]; then CHECK_FLAG=; fi

command -v nvidia-smi >/dev/null || { echo "multigpu.sh needs nvidia-smi and NVIDIA GPUs" >&2; exit 1; }
VISIBLE=$(nvidia-smi -L | grep -c '^GPU')
COUNTS=()
for n in ${GPUS:-1 2 4 8}; do
  if (( n <= VISIBLE )); then COUNTS+=("$n"); else echo "skipping $n GPUs: $VISIBLE visible"; fi
done
(( ${#COUNTS[@]} )) || { echo "no GPU count to run" >&2; exit 1; }
LIST=$(IFS=,; echo "${COUNTS[*]}")
mkdir -p "$OUT"
# results of an earlier run must not mix in
rm -f "$OUT"/baselines_n*.json "$OUT/ours.json" "$OUT"/baselines_train_n*.json "$OUT/ours_train.json"
status=0

echo "== topology"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || echo "nvidia-smi topo -m failed" | tee "$OUT/topo.txt"
cat "$OUT/topo.txt"
python bench/measure_topology.py --out "$OUT/topology.json" || { echo "measure_topology.py failed"; status=1; }

echo "== ours on $LIST GPUs"
TOPO_ARG=()
[[ -f "$OUT/topology.json" ]] && TOPO_ARG=(--topology "$OUT/topology.json")
python bench/multigpu.py ours --gpus "$LIST" --workloads "$WORKLOADS" --chains "$CHAINS" \
  ${TOPO_ARG[@]+"${TOPO_ARG[@]}"} --out "$OUT" ${OURS_ARGS:-} || { echo "ours failed"; status=1; }

for n in "${COUNTS[@]}"; do
  echo "== PyTorch baselines on $n GPUs"
  python -m torch.distributed.run --standalone --nproc_per_node "$n" bench/baselines/run.py \
    --strategy best --workload "$WORKLOADS,$CHAINS" $CHECK_FLAG --json "$OUT/baselines_n$n.json" ${BASELINE_ARGS:-} \
    || { echo "baselines on $n GPUs failed or a check did not pass (see above)"; status=1; }
done

if [[ "${TRAIN:-1}" != "0" ]]; then
  echo "== ours, training step, on $LIST GPUs"
  python bench/multigpu.py train --gpus "$LIST" --workloads "$TRAIN_WORKLOADS" \
    ${TOPO_ARG[@]+"${TOPO_ARG[@]}"} --out "$OUT" ${TRAIN_ARGS:-} || { echo "ours' training step failed"; status=1; }

  for n in "${COUNTS[@]}"; do
    echo "== PyTorch DDP and FSDP2 training steps on $n GPUs"
    python -m torch.distributed.run --standalone --nproc_per_node "$n" bench/baselines/run.py --train \
      --strategy best --workload "$TRAIN_WORKLOADS" $CHECK_FLAG --json "$OUT/baselines_train_n$n.json" \
      ${TRAIN_BASELINE_ARGS:-} \
      || { echo "training baselines on $n GPUs failed or a check did not pass (see above)"; status=1; }
  done
fi

echo "== merge"
python bench/multigpu.py merge --out "$OUT" || status=1
exit $status
