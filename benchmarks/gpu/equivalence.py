"""The equivalence step: the fast path's crops against the PIL path's, then host syncs in fast-path training steps.

``python benchmarks/gpu/equivalence.py --data-dir DIR [--photos 64] [--steps 30] [--json FILE]``

1. The same photos, crop boxes and flips through each way of making a training image:

   * the batched crop (``crop_flip_normalise(batched=True)``: one ``roi_align`` call, on the GPU when
     there is one), as fit runs it on CUDA;
   * the per-image crop (``batched=False``: torchvision's uint8 ``resized_crop``), as fit runs it on CPU;
   * PIL: ``train_transform``'s own crop settings (``RandomResizedCrop``'s size, interpolation and
     antialias, then its flip, ToTensor and Normalize) applied with the same box, once to the cache's
     square and once to the original photo with the box the square's was mapped from. The square rows
     isolate the crop; the original rows add what the cache's squash costs, and are what the fast path
     and the tutorial's loader really differ by.

   The boxes are drawn by ``draw_train_views`` (the training loader's collate); the boxes in the
   originals' pixels by ``sample_crop_boxes`` from a generator in the same state, which is how
   ``draw_train_views`` draws them before mapping them onto the square. Evaluation: ``eval_batch`` on
   each device against PIL's ``eval_transform`` of the original. Differences are in normalised units.

2. ``--steps`` training steps of ``fit`` with configs/tutorial.yaml + configs/fast.yaml (the cache on the
   GPU) under ``torch.cuda.set_sync_debug_mode("error")``, from the end of the warm-up steps to the end of
   the last one (data fetch, transfer, crop, forward, backward and optimizer step all inside): any
   operation that makes the host wait for the GPU fails the step and names where it happened. On CPU the
   steps run without the check ("n/a (CPU)").
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import traceback
from pathlib import Path

import lightning as L
import numpy as np
import report
import torch
from torchvision.transforms import functional as TF

from flowers.cli import cli_main
from flowers.data.batch_augment import crop_flip_normalise, draw_train_views, eval_batch, sample_crop_boxes
from flowers.data.cache import cache_side, ensure_cache, fitting_side
from flowers.data.folders import find_classes, is_split_layout, list_images
from flowers.data.images import load_rgb
from flowers.data.transforms import eval_transform, train_transform

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def pick_photos(data_dir: Path, count: int) -> list[str]:
    """``count`` training photos spread evenly over the sorted list (so every class is in)."""
    folder = data_dir / "train" if is_split_layout(data_dir) else data_dir
    samples = list_images(folder, find_classes(folder))
    step = max(1, len(samples) // count)
    return [s.path for s in samples[::step][:count]]


def _pil_view(image, box, flip: bool, transform) -> torch.Tensor:
    # train_transform's own steps with a given box, instead of RandomResizedCrop's random one.
    crop, _, to_tensor, normalise = transform.transforms
    top, left, height, width = (int(v) for v in box)
    view = TF.resized_crop(image, top, left, height, width, crop.size, crop.interpolation, antialias=crop.antialias)
    return normalise(to_tensor(TF.hflip(view) if flip else view))


def _difference(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = ours.float().cpu() - theirs.float().cpu()
    return {"name": name, "max_abs": diff.abs().max().item(), "mean_abs": diff.abs().mean().item(),
            "mean": diff.mean().item()}


def compare_crops(data_dir: Path, *, photos: int, image_size: int, device: torch.device, seed: int,
                  workdir: Path) -> dict:
    paths = pick_photos(data_dir, photos)
    side = fitting_side(paths, cache_side(image_size))
    cache = ensure_cache(paths, root=workdir, side=side, fallback_dir=workdir / "fallback")  # the library's cache
    squares = torch.from_numpy(np.array(cache.pixels))
    sizes = torch.from_numpy(cache.sizes)
    original_boxes = sample_crop_boxes(sizes, generator=torch.Generator().manual_seed(seed))
    boxes, flip = draw_train_views(sizes, side=side, generator=torch.Generator().manual_seed(seed))
    # Each square box must be its original box scaled onto the square, to within rounding.
    scaled = original_boxes * (side / sizes.double().repeat(1, 2))
    boxes_agree = bool(((boxes.double() - scaled).abs() <= 0.5 + 1e-6).all())

    batched = crop_flip_normalise(squares.to(device), boxes.to(device), flip.to(device), crop_size=image_size,
                                  batched=True)
    each = crop_flip_normalise(squares, boxes, flip, crop_size=image_size, batched=False)
    transform = train_transform(crop_size=image_size)
    originals = [load_rgb(path) for path in paths]
    square_images = [TF.to_pil_image(square) for square in squares]
    pil_square = torch.stack([_pil_view(img, box, bool(f), transform)
                              for img, box, f in zip(square_images, boxes.tolist(), flip.tolist(), strict=True)])
    pil_original = torch.stack([_pil_view(img, box, bool(f), transform)
                                for img, box, f in zip(originals, original_boxes.tolist(), flip.tolist(), strict=True)])
    evaluate = eval_transform(crop_size=image_size)
    pil_eval = torch.stack([evaluate(img) for img in originals])
    where = device.type
    rows = [
        _difference(f"batched roi_align crop ({where}) vs per-image crop (cpu)", batched, each),
        _difference(f"batched crop ({where}) vs PIL crop of the cache square", batched, pil_square),
        _difference("per-image crop (cpu) vs PIL crop of the cache square", each, pil_square),
        _difference(f"batched crop ({where}) vs PIL crop of the original", batched, pil_original),
        _difference("per-image crop (cpu) vs PIL crop of the original", each, pil_original),
        _difference("PIL crop of the cache square vs of the original", pil_square, pil_original),
        _difference(f"eval_batch ({where}) vs PIL eval_transform of the original",
                    eval_batch(squares.to(device), crop_size=image_size), pil_eval),
    ]
    if device.type != "cpu":
        rows.append(_difference("eval_batch (cpu) vs PIL eval_transform of the original",
                                eval_batch(squares, crop_size=image_size), pil_eval))
    if "dtype" in inspect.signature(crop_flip_normalise).parameters:  # bf16 batches, as a bf16 run on CUDA gets
        rows.append(_difference(f"batched crop ({where}) in bfloat16 vs PIL crop of the original", crop_flip_normalise(
            squares.to(device), boxes.to(device), flip.to(device), crop_size=image_size, batched=True,
            dtype=torch.bfloat16), pil_original))
    return {"photos": len(paths), "image_size": image_size, "cache_side": side, "boxes_agree": boxes_agree,
            "flipped": int(flip.sum()), "rows": rows}


class HostSyncCheck(L.Callback):
    """Turns torch's sync debug mode to "error" from the end of the warm-up steps to the end of the last step."""

    def __init__(self, warmup: int, steps: int, armed: bool) -> None:
        self.warmup, self.steps, self.armed = warmup, steps, armed
        self.checked = 0

    def _set(self, mode: str | int) -> None:
        if self.armed:
            torch.cuda.set_sync_debug_mode(mode)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup - 1:
            if self.armed:
                torch.cuda.synchronize()
            self._set("error")
        elif batch_idx >= self.warmup:
            self.checked += 1
            if self.checked == self.steps:
                self._set(0)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._set(0)  # an epoch shorter than the window: its end (metrics, checkpoint) is not a step

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._set(0)  # Lightning's teardown after the error synchronises too


def _where(error: BaseException) -> str:
    """The deepest frame of flowers, Lightning or torchmetrics code: what asked for the sync."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if any(part in f.filename for part in ("/flowers/", "/lightning/", "/torchmetrics/"))]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}: {frame.line}"


def check_training_steps(data_dir: Path, *, steps: int, warmup: int, device: torch.device, workdir: Path,
                         extra: list[str]) -> dict:
    on_cuda = device.type == "cuda"
    args = ["--config", str(CONFIGS / "tutorial.yaml"), "--config", str(CONFIGS / "fast.yaml"),
            "--data.data_dir", str(data_dir), "--trainer.max_epochs=1",
            f"--trainer.limit_train_batches={warmup + steps}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.logger.init_args.save_dir", str(workdir / "runs"),
            f"--trainer.accelerator={'gpu' if on_cuda else 'cpu'}", "--trainer.devices=1", *extra]
    if on_cuda:
        args.append("--data.cache_on_device=true")
    cli = cli_main(args, run=False)
    check = HostSyncCheck(warmup, steps, armed=on_cuda)
    cli.trainer.callbacks.append(check)
    result = {"steps": steps, "warmup": warmup,
              "logging": f"every {cli.trainer.log_every_n_steps} steps (log_every_n_steps)"}
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except RuntimeError as error:
        if not on_cuda or "synchroniz" not in str(error):
            raise
        torch.cuda.set_sync_debug_mode(0)
        print("".join(traceback.format_exception(error)[-8:]), file=sys.stderr)
        return {**result, "status": f"FAILED after {check.checked} clean steps",
                "detail": f"a host sync at {_where(error)}"}
    finally:
        if on_cuda:
            torch.cuda.set_sync_debug_mode(0)
    if check.checked != steps:
        return {**result, "status": f"FAILED: only {check.checked} of {steps} steps ran"}
    if not on_cuda:
        return {**result, "status": "n/a (CPU)", "detail": f"{steps} steps ran without the check"}
    return {**result, "status": "passed", "detail": f"no host sync; the logger writes {result['logging']}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/equivalence.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--photos", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed, unchecked steps first (optimizer state)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fit-args", default="", help="extra `flowers fit` arguments for the training steps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.argv[1:] = []  # LightningCLI gets its arguments as a list; this script's own would look mixed in
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="flowers-equivalence-") as tmp:
        result = compare_crops(args.data_dir, photos=args.photos, image_size=args.image_size, device=device,
                               seed=args.seed, workdir=Path(tmp))
        result["device"] = str(device)
        result["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None}
        if args.json:  # the crops' figures stay even if the training steps fail
            args.json.write_text(json.dumps({**result, "sync_check": {"status": "not run", "steps": args.steps}},
                                            indent=1) + "\n")
        result["sync_check"] = check_training_steps(
            args.data_dir, steps=args.steps, warmup=args.warmup_steps, device=device, workdir=Path(tmp),
            extra=[*args.fit_args.split(), f"--data.image_size={args.image_size}"])
    print(report.heading("equivalence"))
    print(report.equivalence_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["sync_check"]["status"].startswith("FAILED") else 0


if __name__ == "__main__":
    sys.exit(main())
