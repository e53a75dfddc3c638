#!/usr/bin/env bash
# The GPU checks in one call (CI has no GPU), each step under its own time limit:
#   DATA=path/to/flower_photos RESULTS=out/ STEPS="bench modes" benchmarks/gpu/run_all.sh
# DATA defaults to $FLOWERS_DATA_DIR, else data/flower_photos. STEPS (default: bench modes accuracy accuracy_fp32):
#   bench            a plain loop, b fit with the tutorial's settings, c fast.yaml, the compute floor, the loaders
#   modes            check_modes.sh: one GPU fp32/bf16, auto, dp (fp16, bf16, two replicas on GPU 0), ddp on 2+ GPUs
#   accuracy         val accuracy after 10 epochs, a vs c, 4 seeds; accuracy_fp32: the same for c in fp32
#   ablate           c vs c with one setting changed (torch.compile with and without CUDA graphs, the cache in
#                    host memory); ABLATE_MORE adds --ablate flags, e.g. "--ablate trainer.precision=32-true"
#   accuracy_ablate  10-epoch val accuracy of c vs c on the PIL loader (data.cache=false), 4 seeds
#   profile          Lightning's simple profiler (host time per step) over the CLI's fit, fast.yaml and tutorial.yaml
#   ceiling          a, b and c with a network that costs next to nothing: each loop's own ceiling
# Each step writes $RESULTS/<step>.txt as it goes, so a step that runs out of time leaves the others' results.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
DATA=${DATA:-${FLOWERS_DATA_DIR:-$ROOT/data/flower_photos}}
RESULTS=${RESULTS:-$(mktemp -d -t flowers-gpu-results-XXXXXX)}
mkdir -p "$RESULTS"
# The checkout's flowers, installed or not.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BENCH=("$PY" "$ROOT/benchmarks/bench.py")
cd "$ROOT"

STEPS=${STEPS:-bench modes accuracy accuracy_fp32}
[[ " $STEPS " == *" profile "* ]] && STEPS="$STEPS profile_fast profile_tutorial"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to the console and $RESULTS/NAME.txt
    local name=$1 seconds=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name (limit ${seconds}s): $*"
    local start=$SECONDS
    timeout "$seconds" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import torch, lightning, torchvision, jsonargparse; print("torch", torch.__version__, "lightning",
lightning.__version__, "torchvision", torchvision.__version__, "jsonargparse", jsonargparse.__version__,
"cpus", __import__("os").cpu_count())'

step bench "${BENCH_S:-200}" "${BENCH[@]}" --data-dir "$DATA" --variants a,b,c --repeats 3 --epochs 3 \
    --json "$RESULTS/bench.json"
MODES_DIR=$(mktemp -d -t flowers-gpu-modes-XXXXXX)
step modes "${MODES_S:-200}" env PYTHON="$PY" EPOCHS=2 OUT_DIR="$MODES_DIR" "$ROOT/benchmarks/gpu/check_modes.sh"
for log in "$MODES_DIR"/*.log; do  # a failed mode's own log, where its error is
    [ -f "$log" ] || continue
    [ -f "${log%.log}/throughput.json" ] || { echo "--- $log"; tail -n 25 "$log"; } | tee -a "$RESULTS/modes.txt"
done
step accuracy "${ACCURACY_S:-150}" "${BENCH[@]}" --data-dir "$DATA" --variants a,c --repeats 4 --epochs 10 \
    --warmup-batches 0 --json "$RESULTS/accuracy.json"
step accuracy_fp32 "${ACCURACY_S:-150}" "${BENCH[@]}" --data-dir "$DATA" --variants c --repeats 4 --epochs 10 \
    --warmup-batches 0 --fast-precision 32-true --json "$RESULTS/accuracy_fp32.json"
step ablate "${ABLATE_S:-300}" "${BENCH[@]}" --data-dir "$DATA" --variants c --repeats 2 --epochs 3 \
    --ablate "model.compile=true model.compile_mode=reduce-overhead" --ablate model.compile=true \
    --ablate data.cache_on_device=false ${ABLATE_MORE:-} --json "$RESULTS/ablate.json"
step ceiling "${CEILING_S:-90}" "${BENCH[@]}" --data-dir "$DATA" --variants a,b,c --repeats 2 --epochs 1 \
    --network free --json "$RESULTS/ceiling.json"
step accuracy_ablate "${ACCURACY_S:-150}" "${BENCH[@]}" --data-dir "$DATA" --variants c --repeats 4 \
    --epochs 10 --warmup-batches 0 --ablate data.cache=false --json "$RESULTS/accuracy_ablate.json"
PROFILE_DIR=$(mktemp -d -t flowers-gpu-profile-XXXXXX)
for config in fast tutorial; do  # c's and b's settings through the CLI (with its logger and callbacks)
    configs="--config $ROOT/configs/tutorial.yaml"
    [ "$config" = fast ] && configs="$configs --config $ROOT/configs/fast.yaml"
    step "profile_$config" "${PROFILE_S:-120}" bash -c "cd '$PROFILE_DIR' && '$PY' -m flowers fit $configs \
        --data.data_dir '$DATA' --trainer.max_epochs=1 --trainer.limit_val_batches=2 --trainer.profiler=simple 2>&1 \
        | grep -A 24 'FIT Profiler Report'"
done
