#!/usr/bin/env bash
# Every GPU check (CI has no GPU), each step under its own time limit, in calls of at most 5 minutes:
#   DATA=path/to/flower_photos RESULTS=out/ STEPS="env equivalence throughput modes" benchmarks/gpu/run_all.sh
#   DATA=path/to/flower_photos RESULTS=out/ STEPS="env accuracy anatomy ceiling" benchmarks/gpu/run_all.sh
#   benchmarks/gpu/run_all.sh --smoke     # every step on the CPU, tiny data, a few batches (under 2 minutes)
# Steps, run in this order whatever the order of STEPS (default: all of them; limits in seconds, for one
# H200 with 16 CPU cores, each set by <STEP>_S, e.g. ACCURACY_S=300):
#   env          10   the GPU (nvidia-smi), library versions, CPU count
#   equivalence  60   the batched GPU crop vs the per-image CPU crop vs PIL, same photos and boxes; eval
#                     likewise; 30 fast-path training steps under torch.cuda.set_sync_debug_mode("error")
#   throughput  120   a and c eager vs c with CUDA graphs (compile_mode=reduce-overhead), recompiles and
#                     skipped graphs counted; the floor of a whole step captured as one CUDA graph
#   modes       100   check_modes.sh, 6 modes at a time (MODES_PARALLEL)
#   accuracy    190   seeds 0-7 (SEEDS) x {a, c, c on the PIL loader}, 10 epochs, 8 processes at a time;
#                     paired differences with 95 % intervals
#   anatomy      50   where a training step's time goes (Lightning's simple profiler, host and synced)
#   ceiling      40   bench.py --network free: each loop's own ceiling
#   tta         290   time to accuracy: configs/speedrun.yaml beside the tutorial loop, 3 seeds (TTA_SEEDS),
#                     whole processes; a third call: STEPS="env tta"
# The two calls above are 290 s of limits each. Each step writes $RESULTS/<step>.txt (and .json) as it
# goes, so a step that fails or runs out of time leaves the others' results. At the end: five tables
# (equivalence, step anatomy, throughput, accuracy, modes) and each step's result; the exit status is 1
# when any step failed or timed out.
# DATA defaults to $FLOWERS_DATA_DIR, else data/flower_photos. Python: $PYTHON, else the checkout's
# .venv/bin/python, else python3. Scratch files (checkpoints, caches of a read-only DATA) go to $WORK,
# a temporary folder removed at the end unless WORK is set.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GPU=$ROOT/benchmarks/gpu
ORDER="env equivalence throughput modes accuracy anatomy ceiling tta"
SMOKE=0
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run_all.sh: unknown argument $arg (--smoke, --help)" >&2; exit 2 ;;
    esac
done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi
[[ "$PY" == */* && "$PY" != /* ]] && PY=$PWD/$PY  # the steps run elsewhere
STEPS=" ${STEPS:-$ORDER} "
STEPS=${STEPS//,/ }
for name in $STEPS; do
    [[ " $ORDER " == *" $name "* ]] || { echo "run_all.sh: unknown step $name (steps: $ORDER)" >&2; exit 2; }
done
RESULTS=${RESULTS:-$(mktemp -d -t flowers-gpu-results-XXXXXX)}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
[ "$SMOKE" = 1 ] || DATA=$(realpath -m "${DATA:-${FLOWERS_DATA_DIR:-$ROOT/data/flower_photos}}")
if [ -z "${WORK:-}" ]; then
    WORK=$(mktemp -d -t flowers-gpu-work-XXXXXX)
    trap 'rm -rf "$WORK"' EXIT  # its checkpoints take GBs; a WORK that was set is kept
fi
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
: >"$RESULTS/steps.tsv"
# The checkout's flowers, installed or not, and the helpers beside this script.
export PYTHONPATH="$ROOT:$GPU${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Relative paths a run might still use (the cache beside a read-only DATA, lightning_logs) land in $WORK.
cd "$WORK" || exit 2

if [ "$SMOKE" = 1 ]; then
    # The real code of every step, smaller: tiny pictures, 64 px, batch 4, 2 batches, 2 seeds, 1 epoch.
    DATA=$WORK/tiny
    "$PY" "$GPU/tiny_data.py" "$DATA" --per-class 8 >/dev/null || exit 2
    FIT=(--data.image_size=64 --data.batch_size=4 --data.num_workers=0)
    SMALL=(--image-size 64 --batch-size 4 --num-workers 0 --limit-batches 1 --floor-steps 1 --warmup-batches 0)
    EQUIVALENCE=(--photos 8 --image-size 64 --steps 3 "--fit-args=${FIT[*]}")
    SPEED=(--repeats 1 --epochs 2 --floor-steps 2 "--bench-args=${SMALL[*]}")
    CEILING=(--repeats 1 --epochs 1 "${SMALL[@]}")
    ACCURACY=(--seeds 0-1 --epochs 1 --parallel 2 "--bench-args=${SMALL[*]}")
    ANATOMY=(--steps 3 --warmup-steps 1 "--fit-args=${FIT[*]}")
    MODES=(SMOKE=1 PARALLEL=2 DATA="$DATA")
    TTA=(--seeds 0 --no-loop --targets 0.3  # the loop is tests/test_tta.py's
         "--fit-args=${FIT[*]} --data.start_image_size=null --data.eval_image_size=64 --trainer.max_epochs=1 --trainer.limit_train_batches=2 --trainer.accelerator=cpu")
    # Safety nets, several times what each step takes on 2 cores: a shared CI runner can be much slower.
    LIMITS=(env 30 equivalence 120 throughput 120 modes 180 accuracy 180 anatomy 120 ceiling 90 tta 120)
else
    EQUIVALENCE=()
    # No warm-up runs: the table's figures are of the epochs after the first, which warms up.
    SPEED=(--repeats 2 --epochs 2 "--bench-args=--warmup-batches 0")
    CEILING=(--repeats 1 --epochs 2)
    ACCURACY=(--seeds "${SEEDS:-0-7}")
    ANATOMY=()
    # 6 at a time: the three compiling modes (minutes of CPU each) leave three slots for the others.
    MODES=(EPOCHS=2 PARALLEL="${MODES_PARALLEL:-6}")
    TTA=(--seeds "${TTA_SEEDS:-0,1,2}" --targets 0.70,0.80,0.85 "--fit-args=--trainer.accelerator=gpu --trainer.devices=1")
    LIMITS=(env 10 equivalence 60 throughput 120 modes 100 accuracy 190 anatomy 50 ceiling 40 tta 290)
fi
declare -A LIMIT
for ((i = 0; i < ${#LIMITS[@]}; i += 2)); do LIMIT[${LIMITS[i]}]=${LIMITS[i + 1]}; done
echo "run_all.sh: steps:$STEPS; results in $RESULTS; scratch in $WORK; data $DATA; python $PY"

FAILED=()
# step NAME COMMAND...: runs COMMAND under NAME's time limit, output to the console and $RESULTS/NAME.txt.
# timeout signals the step's whole process group, so no process of a timed-out step outlives it.
step() {
    local name=$1
    shift
    [[ "$STEPS" == *" $name "* ]] || return 0
    local variable="${name^^}_S"
    local limit=${!variable:-${LIMIT[$name]}}
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    local code=${PIPESTATUS[0]} result=ok
    case $code in
        0) ;;
        124 | 137) result="timed out after ${limit}s" ;;
        *) result="failed (exit $code)" ;;
    esac
    echo "=== $name: $result after $((SECONDS - start)) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$((SECONDS - start))" "$limit" >>"$RESULTS/steps.tsv"
    [ "$result" = ok ] || FAILED+=("$name")
}

step env "$PY" "$GPU/environment.py" --json "$RESULTS/env.json"
step equivalence "$PY" "$GPU/equivalence.py" --data-dir "$DATA" --json "$RESULTS/equivalence.json" \
    "${EQUIVALENCE[@]}"
step throughput "$PY" "$GPU/speed.py" --data-dir "$DATA" --json "$RESULTS/throughput.json" "${SPEED[@]}"
step modes env PYTHON="$PY" OUT_DIR="$WORK/modes" JSON="$RESULTS/modes.json" "${MODES[@]}" "$GPU/check_modes.sh"
if [[ "$STEPS" == *" modes "* && ! -f "$RESULTS/modes.json" && -f "$WORK/modes/modes.order" ]]; then
    # The step ran out of time: the table of the modes that finished, each failed one's log tail.
    "$PY" "$GPU/modes.py" "$WORK/modes" --json "$RESULTS/modes.json" >>"$RESULTS/modes.txt" 2>&1
fi
step accuracy "$PY" "$GPU/accuracy.py" --data-dir "$DATA" --workdir "$WORK/accuracy" \
    --json "$RESULTS/accuracy.json" "${ACCURACY[@]}"
step anatomy "$PY" "$GPU/anatomy.py" --data-dir "$DATA" --json "$RESULTS/anatomy.json" "${ANATOMY[@]}"
step ceiling "$PY" "$ROOT/benchmarks/bench.py" --data-dir "$DATA" --network free --variants a,b,c \
    --json "$RESULTS/ceiling.json" "${CEILING[@]}"
step tta "$PY" "$ROOT/benchmarks/tta.py" --data-dir "$DATA" --recipe "$ROOT/configs/speedrun.yaml" \
    --json "$RESULTS/tta.json" "${TTA[@]}"

"$PY" "$GPU/report.py" "$RESULTS" | tee "$RESULTS/report.txt"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "run_all.sh: failed: ${FAILED[*]}" >&2
    exit 1
fi
