#!/usr/bin/env bash
# Every GPU check (the tests marked gpu) and every GPU figure, in calls of at most 5 minutes (CI has no GPU):
#   DATA=path/to/flower_photos RESULTS=out/ STEPS="env checks throughput" benchmarks/gpu/run_all.sh
#   benchmarks/gpu/run_all.sh --smoke     # every step on the CPU, tiny data, a few batches (about 2 minutes)
# STEPS (default: all): env checks throughput accuracy anatomy ceiling tta. docs/benchmarks-gpu.md describes the
# three calls that fit 5 minutes each, every step, its time limit (<STEP>_S), its results and the exit status.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ORDER="env checks throughput accuracy anatomy ceiling tta"
SMOKE=0
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run_all.sh: unknown argument $arg (--smoke, --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -n "${PYTHON:-}" ] || [ -x "$PY" ] || PY=python3
[[ "$PY" == */* && "$PY" != /* ]] && PY=$PWD/$PY  # the steps run elsewhere
STEPS=" ${STEPS:-$ORDER} "
STEPS=${STEPS//,/ }
for name in $STEPS; do
    [[ " $ORDER " == *" $name "* ]] || { echo "run_all.sh: unknown step $name (steps: $ORDER)" >&2; exit 2; }
done
RESULTS=${RESULTS:-$(mktemp -d -t flowers-gpu-results-XXXXXX)}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
if [ -z "${WORK:-}" ]; then
    WORK=$(mktemp -d -t flowers-gpu-work-XXXXXX)
    trap 'rm -rf "$WORK"' EXIT  # its checkpoints take GBs; a WORK that was set is kept
fi
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
: >"$RESULTS/steps.tsv"
# The checkout's flowers, installed or not; relative paths a run might use (runs/, a read-only DATA's cache) land in WORK.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$WORK" || exit 2
BENCH=("$PY" "$ROOT/benchmarks/bench.py")
TTA=("${BENCH[@]}" --tta --recipe "$ROOT/configs/speedrun.yaml")
if [ "$SMOKE" = 1 ]; then
    # The real code of every step, smaller: the synthetic flowers at 64 px, batch 4, a batch or two an epoch.
    DATA=$WORK/synthetic
    "$PY" -c "import sys; from flowers.data.synthetic import ensure_synthetic; ensure_synthetic(sys.argv[1], per_class=8, size=72)" "$DATA" || exit 2
    SMALL=(--image-size 64 --batch-size 4 --num-workers 0 --limit-batches 1 --floor-steps 1 --warmup-batches 0)
    SPEED=(--repeats 1 --epochs 2 "${SMALL[@]}")
    ACCURACY=(--repeats 2 --parallel 2 --epochs 1 "${SMALL[@]}")
    ANATOMY=(--anatomy 2 "${SMALL[@]}" --warmup-batches 1)
    CEILING=(--repeats 1 --epochs 1 "${SMALL[@]}")
    TTA+=(--repeats 1 --no-loop --targets 0.3  # the loop is tests/test_tta.py's
          "--fit-args=--budget=null --data.image_size=64 --data.batch_size=4 --data.num_workers=0 --data.start_image_size=null --data.eval_image_size=64 --trainer.max_epochs=1 --trainer.limit_train_batches=2 --trainer.accelerator=cpu")
    export FLOWERS_GPU_SMOKE=1
    # Safety nets, several times what each step takes on 2 cores: a shared CI runner can be much slower.
    declare -A LIMIT=([env]=30 [checks]=240 [throughput]=120 [accuracy]=120 [anatomy]=90 [ceiling]=90 [tta]=120)
else
    DATA=$(realpath -m "${DATA:-${FLOWERS_DATA_DIR:-$ROOT/data/flower_photos}}")
    # No warm-up runs: the table's steady figures are of the epochs after the first, which warms up.
    SPEED=(--repeats 2 --epochs 2 --warmup-batches 0 --graph-floor --floor-steps 100
           --ablate "model.compile=true model.compile_mode=reduce-overhead data.drop_last=true")
    ACCURACY=(--repeats "${SEEDS:-8}" --parallel 8 --epochs 10)
    ANATOMY=(--anatomy 50 --warmup-batches 10)
    CEILING=(--repeats 1 --epochs 2)
    TTA+=(--repeats "${TTA_SEEDS:-3}" --targets 0.70,0.80,0.85
          "--fit-args=--budget=null --trainer.accelerator=gpu --trainer.devices=1")  # its 20 epochs, as measured
    declare -A LIMIT=([env]=10 [checks]=160 [throughput]=120 [accuracy]=190 [anatomy]=50 [ceiling]=40 [tta]=290)
fi
export FLOWERS_DATA_DIR=$DATA
echo "run_all.sh: steps:$STEPS; results in $RESULTS; scratch in $WORK; data $DATA; python $PY"

FAILED=()
# step NAME COMMAND...: COMMAND under NAME's time limit; its stdout (the table) to the console and NAME.txt, its
# stderr (progress) to NAME.log. timeout signals the whole process group: nothing of a timed-out step outlives it.
step() {
    local name=$1
    shift
    [[ "$STEPS" == *" $name "* ]] || return 0
    local variable="${name^^}_S"
    local limit=${!variable:-${LIMIT[$name]}} start=$SECONDS result=ok
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=15 "$limit" "$@" 2>"$RESULTS/$name.log" | tee "$RESULTS/$name.txt"
    local code=${PIPESTATUS[0]}
    case $code in
        0) ;;
        124 | 137) result="timed out after ${limit}s" ;;
        *) result="failed (exit $code)" ;;
    esac
    [ "$result" = ok ] || { tail -n 15 "$RESULTS/$name.log"; FAILED+=("$name"); }
    echo "=== $name: $result after $((SECONDS - start)) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$((SECONDS - start))" "$limit" >>"$RESULTS/steps.tsv"
}

step env bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU"
    echo "$(nproc) CPUs, $("$0" --version)"
    "$0" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE "^(torch|torchvision|lightning|jsonargparse|pytest) "
    true' "$PY"
step checks "$PY" -m pytest -p no:cacheprovider -q -m gpu -rs --durations=5 "$ROOT/tests/gpu"
TORCH_LOGS=recompiles,cudagraphs step throughput "${BENCH[@]}" --variants a,c "${SPEED[@]}"
if [ -s "$RESULTS/throughput.log" ]; then  # a graph torch skipped runs eagerly
    echo "recompiles: $(grep -c 'Recompiling function' "$RESULTS/throughput.log"), skipped CUDA graphs:" \
        "$(grep -c 'skipping cudagraphs' "$RESULTS/throughput.log")" | tee -a "$RESULTS/throughput.txt"
fi
step accuracy "${BENCH[@]}" --variants a,c --ablate data.cache=false "${ACCURACY[@]}"
step anatomy bash -c '"$@" && { [ "${FLOWERS_GPU_SMOKE:-}" = 1 ] || CUDA_LAUNCH_BLOCKING=1 "$@"; }' - \
    "${BENCH[@]}" --variants b,c "${ANATOMY[@]}"
step ceiling "${BENCH[@]}" --network free --variants a,b,c "${CEILING[@]}"
step tta "${TTA[@]}"

while IFS=$'\t' read -r name result seconds limit; do
    echo "==== $name: $result ($seconds s of $limit)"
    cat "$RESULTS/$name.txt"
done <"$RESULTS/steps.tsv" | tee "$RESULTS/report.txt"
[ "${#FAILED[@]}" -eq 0 ] || { echo "run_all.sh: failed: ${FAILED[*]}" >&2; exit 1; }
