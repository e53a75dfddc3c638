#!/usr/bin/env bash
# Every training mode this CUDA machine allows, by hand (CI has no GPU):
#   benchmarks/gpu/check_modes.sh            # 3 short epochs each
#   EPOCHS=5 IMAGE_SIZE=224 benchmarks/gpu/check_modes.sh
# Runs a short fit per mode on the synthetic flowers and prints a table: mode, strategy, processes x
# devices, precision, the dtype the network's last layer computed in (bf16 runs must say bfloat16,
# also under dp), images/s (epochs after the first), final val/acc and whether the checkpoint's
# state_dict keys are exactly those of the first (one-GPU) run. Each run's log is in $OUT_DIR/<mode>.log.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT_DIR=${OUT_DIR:-$(mktemp -d -t flowers-gpu-XXXXXX)}
EPOCHS=${EPOCHS:-3}
IMAGE_SIZE=${IMAGE_SIZE:-224}
BATCH=${BATCH:-64}
TIMEOUT=${TIMEOUT:-900}
# The checkout's flowers (installed or not), and the Throughput callback beside this script.
export PYTHONPATH="$ROOT:$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}"

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -lt 1 ]; then
    echo "check_modes.sh: no CUDA GPU visible; nothing to check." >&2
    exit 1
fi
BF16=$("$PY" -c 'import torch; print(int(torch.cuda.is_bf16_supported()))')
echo "GPUs: $NGPU (bf16: $BF16); output in $OUT_DIR"

COMMON=(
    --trainer.max_epochs="$EPOCHS"
    --trainer.enable_progress_bar=false
    --data.image_size="$IMAGE_SIZE"
    --data.batch_size="$BATCH"
    --data.synthetic_dir="$OUT_DIR/synthetic"
    --data.synthetic_per_class=200
    "--trainer.callbacks+=throughput.Throughput"
)
FAILED=()

# run_mode NAME ARGS...: one fit in its own folder, so each run is runs/flowers/version_0 there.
run_mode() {
    local name=$1
    shift
    mkdir -p "$OUT_DIR/$name"
    echo "== $name: flowers fit $*"
    if ! (cd "$OUT_DIR/$name" && timeout "$TIMEOUT" "$PY" -m flowers fit "${COMMON[@]}" \
            --trainer.callbacks.out_dir="$OUT_DIR/$name" "$@") >"$OUT_DIR/$name.log" 2>&1; then
        echo "   FAILED, see $OUT_DIR/$name.log"
        FAILED+=("$name")
    fi
}

run_mode gpu --config "$ROOT/configs/gpu.yaml" --trainer.precision=32-true
run_mode auto --trainer.accelerator=auto --trainer.devices=auto --trainer.strategy=auto
if [ "$BF16" = 1 ]; then
    run_mode gpu-bf16 --config "$ROOT/configs/gpu.yaml"
fi
run_mode dp --config "$ROOT/configs/dp.yaml"
run_mode dp-16 --config "$ROOT/configs/dp.yaml" --trainer.precision=16-mixed
if [ "$BF16" = 1 ]; then
    run_mode dp-bf16 --config "$ROOT/configs/dp.yaml" --trainer.precision=bf16-mixed
fi
# Two replicas on one GPU: scatter, replicate, parallel_apply and gather all run, even on one GPU.
run_mode dp-repeat-gpu0 --trainer.accelerator=gpu --trainer.devices=1 \
    --trainer.strategy=flowers.strategies.DataParallelStrategy '--trainer.strategy.init_args.device_ids=[0, 0]'
if [ "$NGPU" -ge 2 ]; then
    run_mode ddp --config "$ROOT/configs/ddp.yaml"
    if [ "$BF16" = 1 ]; then
        run_mode ddp-bf16 --config "$ROOT/configs/ddp.yaml" --trainer.precision=bf16-mixed
    fi
fi

"$PY" - "$OUT_DIR" <<'PYTHON'
import json
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
rows, reference = [], None
for log in sorted(out.glob("*.log"), key=lambda p: p.stat().st_mtime):
    record_file = out / log.stem / "throughput.json"
    if not record_file.is_file():
        rows.append((log.stem, "FAILED", "", "", "", "", "", ""))
        continue
    r = json.loads(record_file.read_text())
    keys = list(torch.load(r["last_ckpt"], map_location="cpu", weights_only=True)["state_dict"])
    reference = reference or keys  # the first run: one GPU
    same = "same as 1st run" if keys == reference else "DIFFERENT"
    prefixed = any(k.startswith("module.") or ".module." in k for k in keys)
    rows.append((log.stem, r["strategy"], f'{r["world_size"]}x{r["devices"]}', r["precision"],
                 ",".join(d.replace("torch.", "") for d in r["replica_dtypes"]),
                 f'{r["images_per_s"]:.0f}' if r["images_per_s"] else "?", f'{r["val_acc"]:.3f}',
                 f'{len(keys)} keys, {same}' + (", module. prefix!" if prefixed else "")))
header = ("mode", "strategy", "procs x dev", "precision", "compute dtype", "images/s", "val/acc", "checkpoint")
widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
for row in [header, *rows]:
    print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
PYTHON

if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "failed modes: ${FAILED[*]}" >&2
    exit 1
fi
