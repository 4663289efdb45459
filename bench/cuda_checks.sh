#!/usr/bin/env bash
# The GPU checks of the budget planner and of GPU speed (issues 13 and 14), on a lent CUDA device.
# Each step has its own time limit and writes its log under $OUT (default /tmp/remat-cuda) as it
# goes, so one slow configuration costs nothing else. Steps: budget, anchor, table, fit, unbudgeted,
# real, sdpa, modes, scale.
#
#     bash bench/cuda_checks.sh budget table      # the budget sweep, then issue 14's four configurations
#
# A lease of 15 minutes of device time (start-up included) does not hold every step. By what the
# open issues still need measured, in two calls of at most 600 s:
#     bash bench/cuda_checks.sh real sdpa         # issue 14: the model of real size, and with SDPA (585 s)
#     bash bench/cuda_checks.sh anchor table      # issue 13 (remat at budget 0.1's peak) and 14 (0.6x)
# (`budget` is the whole sweep of five budgets: eleven compiles; `anchor` two of its budgets.)
set -u
OUT=${OUT:-/tmp/remat-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 REMAT_STRICT=1
PY=${PYTHON:-python3}
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.log"
    local begin=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - begin))s" | tee -a "$OUT/summary.log"
    tail -n 25 "$OUT/$name.log" | tee -a "$OUT/summary.log"
}
for what in "$@"; do
    case $what in
    budget)   # issue 13: the torch sweep on CUDA; remat at activation_memory_budget=0.1's peak
        step budget 390 $PY bench/budget.py --torch --skip-onnx --device cuda --rounds 1 --repeats 20 ;;
    anchor)   # issue 13's must-show 2 (remat at activation_memory_budget=0.1's measured peak, its step
              # against budget 0.1's) and issue 14's 0.6x of compile's peak at vocab 4096, one sweep
        step anchor 330 $PY bench/budget.py --torch --skip-onnx --device cuda --rounds 1 --repeats 20 --fractions 0.6 ;;
    table)    # issue 14: GPT-like d256, 4 layers, seq 512 at vocab 32768, batch 4 (vocab 4096 is the budget sweep's)
        step table32768 200 $PY bench/torch_step.py --device cuda --repeats 20 --json --vocab 32768 --batch 4 \
            --configs eager compile budget-0.1 remat-budget-0.6 remat-budget-0.5 ;;
    fit)      # the fastest step that fits a smaller GPU: the allocator capped at 320 MiB (torch.compile
              # took 462 MiB above ~22 MiB of weights and batch on an H100), so compile runs out of memory
        step fit 300 $PY bench/torch_step.py --device cuda --repeats 20 --json --device-memory 320 \
            --configs compile budget-0.1 remat-budget-free-0 remat ;;
    unbudgeted)   # every plan the rules match, as before the planner
        step unbudgeted 200 $PY bench/torch_step.py --device cuda --repeats 20 --json --configs remat remat-expensive ;;
    real)     # issue 14: the model of real size
        step real 340 $PY bench/scale.py --device cuda --layers 8 --seq 1024 --d-model 1024 --heads 16 \
            --vocab 32768 --batch 8 --repeats 5 --timeout 110 --torch-budget 0.1 --eager ;;
    sdpa)
        step sdpa 245 $PY bench/scale.py --device cuda --layers 8 --seq 1024 --d-model 1024 --heads 16 \
            --vocab 32768 --batch 8 --repeats 10 --timeout 80 --torch-budget 0.1 --attention sdpa --eager ;;
    modes)    # torch.compile's modes with remat: CUDA graphs (reduce-overhead), autotuned kernels
        step reduce-overhead 300 $PY bench/torch_step.py --device cuda --repeats 20 --json --mode reduce-overhead \
            --configs eager compile remat remat-budget-0.6
        step max-autotune 420 $PY bench/torch_step.py --device cuda --repeats 20 --json \
            --mode max-autotune-no-cudagraphs --configs eager compile remat-budget-0.6 ;;
    scale)
        step scale 560 $PY bench/scale.py --device cuda --layers 4 8 16 32 --seq 1024 --repeats 10 --timeout 120 ;;
    *) echo "unknown step: $what" >&2; exit 2 ;;
    esac
done
