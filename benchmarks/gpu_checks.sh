#!/bin/bash
# Every GPU test file (any test marked gpu), each under its own time limit, spread over the GPUs
# present: one lane per GPU for the single-GPU files, each lane with its own cores so lanes do not slow
# each other's hosts; then the multi-GPU files (tensor parallelism, the fused all-reduce) with every GPU
# visible (their 4-rank cases need four).
# Prints one line per file and keeps each file's log.
#
#   BUDGET_S=540 bash benchmarks/gpu_checks.sh [single|tp|all] [LOG_DIR]   # default: all, ./gpu-logs or $OUT
#
# BUDGET_S (default 3600) bounds the whole run: a file is not started once its lane is past the budget
# (it is listed as not run), and none runs past it, so a call limited in time still returns every line.
#
# A GPU is never shared between lanes: a tensor-parallel engine beside another process on its GPU sizes
# its KV cache from what is left and can find no room.
set -u
MODE=${1:-all}
LOGS=${2:-${OUT:-gpu-logs}}
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/platform"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
CORES=$(nproc)
BUDGET_S=${BUDGET_S:-3600}
[ "$GPUS" -ge 1 ] || { echo "no CUDA GPU"; exit 1; }

# every file with a test marked gpu; the multi-GPU ones run last, over every GPU, with their limits
TP_FILES=(tests/engine/test_fused_allreduce_gpu.py tests/engine/test_tensor_parallel_gpu.py)
TP_LIMITS=(420 580)
mapfile -t SINGLE < <(grep -rl "mark.gpu" tests --include='test_*.py' | grep -v -F -e "${TP_FILES[0]}" -e "${TP_FILES[1]}" | sort)
limit_of() { case $1 in *test_models_gpu.py) echo 480 ;; *) echo 300 ;; esac; }

run_file() { # GPU-list core-range file [limit]
  local file=$3 limit=${4:-$(limit_of "$3")} name left=$((BUDGET_S - SECONDS))
  name=$(basename "$file" .py)
  if [ "$left" -lt 30 ]; then
    printf '%-40s not run (budget)\n' "$name"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$SECONDS
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$limit" taskset -c "$2" \
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -s "$file" > "$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-40s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - started)) \
    "$(grep -E '^[0-9]+ (passed|failed|skipped|deselected|error)' "$LOGS/$name.log" | tail -1)"
}

if [ "$MODE" != tp ]; then
  lanes=$GPUS
  per=$((CORES / lanes))
  for ((lane = 0; lane < lanes; lane++)); do
    (
      for ((i = lane; i < ${#SINGLE[@]}; i += lanes)); do
        run_file "$lane" "$((lane * per))-$((lane * per + per - 1))" "${SINGLE[$i]}"
      done
    ) &
  done
  wait
fi
if [ "$MODE" != single ]; then
  if [ "$GPUS" -ge 2 ]; then
    for i in "${!TP_FILES[@]}"; do
      run_file "$(seq -s, 0 $((GPUS - 1)))" "0-$((CORES - 1))" "${TP_FILES[$i]}" "${TP_LIMITS[$i]}"
    done
  else
    echo "tensor-parallel files skipped: one GPU"
  fi
fi
