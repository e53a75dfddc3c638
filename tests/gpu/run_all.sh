#!/usr/bin/env bash
# Every GPU-specific check in one call, for a machine lent for a few minutes (CI has no GPU):
#   DATA=path/to/flower_photos RESULTS=out/ tests/gpu/run_all.sh
# 1. the benchmark on the real photos: plain loop (a), fit with the tutorial's settings (b), fast.yaml (c),
#    compute floor and loaders, on CUDA (issue 5's GPU targets: c >= 5x a, c >= 50 % of the floor);
# 2. tests/gpu/check_modes.sh: one GPU fp32/bf16, auto, dp (fp16, bf16, two replicas on GPU 0), ddp if 2+ GPUs;
# 3. val accuracy after 10 epochs, a vs c, over 4 seeds (cheap here, slow on 2 CPU cores), and c in fp32;
# 4. (only when named in STEPS) "ablate": c against c with one setting changed each (torch.compile with
#    CUDA graphs and in its default mode, the cache in host memory; ABLATE_MORE adds --ablate flags, e.g.
#    ABLATE_MORE="--ablate trainer.precision=32-true"), the speed share of each; "accuracy_ablate": the
#    10-epoch accuracy of c against c on the PIL loader (data.cache=false), 4 seeds; "profile": where the
#    host's time goes in each training step of the CLI's fit with fast.yaml and with the tutorial's settings
#    (Lightning's simple profiler: on a GPU its times are the host's, which bounds a launch-bound step);
#    "ceiling": a, b and c with a network that costs next to nothing (bench --network free), each
#    loop's own ceiling: whether c >= 5x a is reachable at all by making the network faster.
# STEPS picks a subset, e.g. STEPS="bench accuracy" (default: steps 1-3). A device session has about 12
# minutes of commands in 10-minute calls: e.g. STEPS="bench ablate" in one call, STEPS="ceiling profile
# accuracy_ablate" in the next.
# Each part has its own time limit and writes its output to $RESULTS as it goes, so a part that runs
# out of time still leaves the others' results.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
DATA=${DATA:-$ROOT/data/flower_photos}
RESULTS=${RESULTS:-$(mktemp -d -t flowers-gpu-results-XXXXXX)}
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
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

step bench "${BENCH_S:-200}" "$PY" -m flowers.bench --data-dir "$DATA" --variants a,b,c --repeats 3 --epochs 3 \
    --json "$RESULTS/bench.json"
MODES_DIR=$(mktemp -d -t flowers-gpu-modes-XXXXXX)
step modes "${MODES_S:-200}" env PYTHON="$PY" EPOCHS=2 OUT_DIR="$MODES_DIR" "$ROOT/tests/gpu/check_modes.sh"
for log in "$MODES_DIR"/*.log; do  # a failed mode's own log, where its error is
    [ -f "$log" ] || continue
    [ -f "${log%.log}/throughput.json" ] || { echo "--- $log"; tail -n 25 "$log"; } | tee -a "$RESULTS/modes.txt"
done
step accuracy "${ACCURACY_S:-150}" "$PY" -m flowers.bench --data-dir "$DATA" --variants a,c --repeats 4 --epochs 10 \
    --warmup-batches 0 --json "$RESULTS/accuracy.json"
step accuracy_fp32 "${ACCURACY_S:-150}" "$PY" -m flowers.bench --data-dir "$DATA" --variants c --repeats 4 --epochs 10 \
    --warmup-batches 0 --fast-precision 32-true --json "$RESULTS/accuracy_fp32.json"
step ablate "${ABLATE_S:-300}" "$PY" -m flowers.bench --data-dir "$DATA" --variants c --repeats 2 --epochs 3 \
    --ablate "model.compile=true model.compile_mode=reduce-overhead" --ablate model.compile=true \
    --ablate data.cache_on_device=false ${ABLATE_MORE:-} --json "$RESULTS/ablate.json"
step ceiling "${CEILING_S:-90}" "$PY" -m flowers.bench --data-dir "$DATA" --variants a,b,c --repeats 2 --epochs 1 \
    --network free --json "$RESULTS/ceiling.json"
step accuracy_ablate "${ACCURACY_S:-150}" "$PY" -m flowers.bench --data-dir "$DATA" --variants c --repeats 4 \
    --epochs 10 --warmup-batches 0 --ablate data.cache=false --json "$RESULTS/accuracy_ablate.json"
PROFILE_DIR=$(mktemp -d -t flowers-gpu-profile-XXXXXX)
for config in fast tutorial; do  # c's and b's settings through the CLI (with its logger and callbacks)
    configs="--config $ROOT/configs/tutorial.yaml"
    [ "$config" = fast ] && configs="$configs --config $ROOT/configs/fast.yaml"
    step "profile_$config" "${PROFILE_S:-120}" bash -c "cd '$PROFILE_DIR' && '$PY' -m flowers fit $configs \
        --data.data_dir '$DATA' --trainer.max_epochs=1 --trainer.limit_val_batches=2 --trainer.profiler=simple 2>&1 \
        | grep -A 24 'FIT Profiler Report'"
done
