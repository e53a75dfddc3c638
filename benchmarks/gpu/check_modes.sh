#!/usr/bin/env bash
# Every training mode this machine allows, each a short `flowers fit` (CI has no GPU):
#   benchmarks/gpu/check_modes.sh                      # 3 short epochs each, one mode at a time
#   EPOCHS=2 PARALLEL=4 benchmarks/gpu/check_modes.sh  # 4 modes at a time: quicker, images/s not comparable
#   SMOKE=1 benchmarks/gpu/check_modes.sh              # the CPU equivalents, 1 epoch of 2 batches at 64 px
# On CUDA: one GPU in fp32 and bf16 and auto, each also with the fast path (configs/fast.yaml, the cache on
# the GPU, mirror evaluation, torch.compile with CUDA graphs); dp in fp32, fp16 and bf16, with two replicas
# on GPU 0, and with the fast path and its cache on GPU 0 (without compile: dp with compile must be refused
# with a one-paragraph error, which one row expects); deterministic training at 224 px, where the network's
# adaptive pool is the identity, and at 192 px, where it is not; ddp (and dp across two physical GPUs)
# where 2+ GPUs are visible, else skipped and said so.
# With SMOKE=1, on the CPU: one process with the fast settings (no compile), ddp with 2 processes, dp
# (which runs the plain forward without CUDA), deterministic at IMAGE_SIZE.
# The table: mode, result, strategy, processes x devices, precision, the dtype the network's last layer
# computed in (bf16 runs must say bfloat16, also under dp), images/s (epochs after the first), final
# val/acc and whether the checkpoint's keys are exactly those of the first run. Each log: $OUT_DIR/<mode>.log.
# Settings: DATA (a photos folder; unset: the synthetic flowers), EPOCHS, IMAGE_SIZE, BATCH, PARALLEL,
# TIMEOUT (seconds per mode), JSON (also write the table there), PYTHON.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi
SMOKE=${SMOKE:-0}
OUT_DIR=$(realpath -m "${OUT_DIR:-$(mktemp -d -t flowers-modes-XXXXXX)}")  # absolute: each mode runs in its own folder
if [ "$SMOKE" = 1 ]; then
    EPOCHS=${EPOCHS:-1} IMAGE_SIZE=${IMAGE_SIZE:-64} BATCH=${BATCH:-4}
else
    EPOCHS=${EPOCHS:-3} IMAGE_SIZE=${IMAGE_SIZE:-224} BATCH=${BATCH:-32}
fi
PARALLEL=${PARALLEL:-1}
TIMEOUT=${TIMEOUT:-900}
CONFIGS=$ROOT/configs
mkdir -p "$OUT_DIR"
# The checkout's flowers (installed or not), and the Throughput callback beside this script.
export PYTHONPATH="$ROOT:$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}"

COMMON=(
    --trainer.max_epochs="$EPOCHS"
    --trainer.enable_progress_bar=false
    --trainer.enable_model_summary=false
    --data.image_size="$IMAGE_SIZE"
    --data.batch_size="$BATCH"
    "--trainer.callbacks+=throughput.Throughput"
)
if [ -n "${DATA:-}" ]; then
    COMMON+=(--data.data_dir="$(realpath -m "$DATA")")
else
    COMMON+=(--data.synthetic_dir="$OUT_DIR/synthetic" --data.synthetic_per_class="${SYNTHETIC_PER_CLASS:-200}")
fi
if [ "$SMOKE" = 1 ]; then
    COMMON+=(--trainer.limit_train_batches=2 --trainer.limit_val_batches=1 --data.num_workers=0)
fi
SKIPPED=()
: >"$OUT_DIR/modes.order"

# start_mode NAME EXPECT ARGS...: one fit in its own folder (its run is runs/flowers/version_0 there),
# PARALLEL at a time; --foreground keeps it in this script's process group, which a limit around us signals.
start_mode() {
    local name=$1 expect=$2
    shift 2
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    mkdir -p "$OUT_DIR/$name"
    echo "$name" >>"$OUT_DIR/modes.order"
    echo "$expect" >"$OUT_DIR/$name.expect"
    rm -f "$OUT_DIR/$name.status"
    echo "== $name: flowers fit $*"
    (
        cd "$OUT_DIR/$name" && timeout --foreground "$TIMEOUT" "$PY" -m flowers fit "${COMMON[@]}" \
            --trainer.callbacks.out_dir="$OUT_DIR/$name" "$@" >"$OUT_DIR/$name.log" 2>&1
        echo $? >"$OUT_DIR/$name.status"
    ) &
}
run_mode() { local name=$1; shift; start_mode "$name" ok "$@"; }
# expect_refusal NAME WORD ARGS...: the fit must stop with a `flowers: error:` naming WORD, no traceback.
expect_refusal() { local name=$1 word=$2; shift 2; start_mode "$name" "refused $word" "$@"; }

if [ "$SMOKE" = 1 ]; then
    echo "SMOKE=1: the CPU equivalents; output in $OUT_DIR"
    FAST=(--config "$CONFIGS/fast.yaml" --model.eval_hflip=true)
    run_mode cpu-fast --config "$CONFIGS/cpu.yaml" "${FAST[@]}"
    run_mode ddp-cpu --config "$CONFIGS/ddp_cpu.yaml" "${FAST[@]}"
    run_mode dp-cpu --trainer.accelerator=cpu --trainer.devices=1 --trainer.strategy=dp
    # At 64 px the adaptive pool is not the identity; whether it is matters on CUDA only (its backward).
    run_mode "deterministic-$IMAGE_SIZE" --config "$CONFIGS/cpu.yaml" "${FAST[@]}" --trainer.deterministic=true
    SKIPPED+=("the CUDA modes: SMOKE=1 runs their CPU equivalents")
else
    read -r NGPU BF16 < <("$PY" -c 'import torch; n = torch.cuda.device_count()
print(n, int(n > 0 and torch.cuda.is_bf16_supported()))')
    if [ "${NGPU:-0}" -lt 1 ]; then
        echo "check_modes.sh: no CUDA GPU visible; nothing to check (SMOKE=1 runs the CPU equivalents)." >&2
        exit 1
    fi
    echo "GPUs: $NGPU (bf16: $BF16); $PARALLEL mode(s) at a time; output in $OUT_DIR"
    FAST=(--config "$CONFIGS/fast.yaml" --model.eval_hflip=true --data.cache_on_device=true)
    GRAPHS=(--model.compile=true --model.compile_mode=reduce-overhead --data.drop_last=true)
    DP_GPU0=(--trainer.accelerator=gpu --trainer.devices=1 --trainer.strategy=flowers.strategies.DataParallelStrategy
        '--trainer.strategy.init_args.device_ids=[0, 0]')
    # The compiling modes first: they take longest, and run beside the others when PARALLEL > 1.
    run_mode gpu --config "$CONFIGS/gpu.yaml" --trainer.precision=32-true
    run_mode gpu-fast --config "$CONFIGS/gpu.yaml" --trainer.precision=32-true "${FAST[@]}" "${GRAPHS[@]}"
    run_mode auto-fast --trainer.accelerator=auto --trainer.devices=auto --trainer.strategy=auto "${FAST[@]}" \
        "${GRAPHS[@]}"
    if [ "$BF16" = 1 ]; then
        run_mode gpu-bf16-fast --config "$CONFIGS/gpu.yaml" "${FAST[@]}" "${GRAPHS[@]}"
        run_mode gpu-bf16 --config "$CONFIGS/gpu.yaml"
    fi
    run_mode auto --trainer.accelerator=auto --trainer.devices=auto --trainer.strategy=auto
    run_mode dp --config "$CONFIGS/dp.yaml"
    run_mode dp-16 --config "$CONFIGS/dp.yaml" --trainer.precision=16-mixed
    if [ "$BF16" = 1 ]; then
        run_mode dp-bf16 --config "$CONFIGS/dp.yaml" --trainer.precision=bf16-mixed
    fi
    # Two replicas on one GPU: scatter, replicate, parallel_apply and gather all run, even on one GPU.
    run_mode dp-repeat-gpu0 "${DP_GPU0[@]}"
    run_mode dp-fast-cache-gpu0 --config "$CONFIGS/dp.yaml" "${FAST[@]}"
    run_mode dp-repeat-gpu0-fast "${DP_GPU0[@]}" "${FAST[@]}"
    expect_refusal dp-compile-refused compile --config "$CONFIGS/dp.yaml" "${FAST[@]}" "${GRAPHS[@]}"
    for size in 224 192; do
        run_mode "deterministic-$size" --config "$CONFIGS/gpu.yaml" "${FAST[@]}" --trainer.deterministic=true \
            --data.image_size="$size"
    done
    if [ "$NGPU" -ge 2 ]; then
        run_mode ddp --config "$CONFIGS/ddp.yaml"
        if [ "$BF16" = 1 ]; then
            run_mode ddp-bf16 --config "$CONFIGS/ddp.yaml" --trainer.precision=bf16-mixed
        fi
        run_mode ddp-fast --config "$CONFIGS/ddp.yaml" "${FAST[@]}" "${GRAPHS[@]}"
    else
        SKIPPED+=("ddp, ddp-bf16, ddp-fast: need 2 GPUs, 1 is visible")
        SKIPPED+=("dp across two physical GPUs: 1 GPU is visible (the dp rows ran one replica, dp-repeat-gpu0 two on GPU 0)")
    fi
fi
wait

SUMMARY=("$PY" "$ROOT/benchmarks/gpu/modes.py" "$OUT_DIR" --parallel "$PARALLEL")
[ -n "${JSON:-}" ] && SUMMARY+=(--json "$JSON")
for why in "${SKIPPED[@]}"; do SUMMARY+=(--skipped "$why"); done
"${SUMMARY[@]}"
