"""``flowers export``: a checkpoint's plain network for use outside Lightning.

Formats, each written into ``--output`` (default ``<checkpoint folder>/export``) with ``class_indices.json``,
named after the backbone (``AlexNet`` for the tutorial's network, else its torchvision name, e.g. ``resnet18``):
  state_dict   ``AlexNet.pth``, the tutorial's file: keys ``features.0.weight`` …, loads into the tutorial's class
               (``resnet18.pth`` loads into ``torchvision.models.resnet18(num_classes=N)``)
  onnx         ``AlexNet.onnx``, input ``images`` [batch, 3, S, S] normalised as in training, output ``logits``;
               the recommended format outside PyTorch
  torchscript  ``AlexNet.torchscript.pt`` (``torch.jit.load``; no flowers code needed); torch deprecates
               TorchScript, so it stays only while torch ships it
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

import torch

from flowers import backbones, checks, inference, runs
from flowers.alexnet import MIN_IMAGE_SIZE
from flowers.errors import ArgumentParser, ConfigError
from flowers.files import atomic_write, can_create, special_kind
from flowers.runs import CLASS_INDICES, write_class_indices

SUFFIXES = {"state_dict": ".pth", "torchscript": ".torchscript.pt", "onnx": ".onnx"}


def filename(backbone: str, fmt: str) -> str:
    """``AlexNet.pth`` for the tutorial's network (the tutorial's own file name), ``resnet18.pth`` …"""
    return ("AlexNet" if backbone == backbones.TUTORIAL_ALEXNET else backbone) + SUFFIXES[fmt]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="flowers export", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--ckpt_path", required=True,
                   help="a checkpoint written by `fit`, or best or last: the newest run's under runs/flowers/")
    p.add_argument("--format", choices=sorted(SUFFIXES), default="state_dict")
    p.add_argument("--output", help="folder for the exported files (default: <checkpoint folder>/export)")
    p.add_argument("--image_size", type=int,
                   help="side of the example input for tracing (default: the side the run evaluated at, as the "
                        "checkpoint records it)")
    return p


def export(ckpt_path: str | Path, fmt: str, output: str | Path | None = None, image_size: int | None = None) -> Path:
    ready = inference.load(ckpt_path)  # also best and last; refuses a file that is not plain data
    net = ready.model.net.eval()
    class_names, ckpt_path = ready.classes, ready.path
    folder = Path(output) if output else ckpt_path.parent / "export"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / filename(ready.hparams.get("backbone", backbones.TUTORIAL_ALEXNET), fmt)
    example = torch.randn(2, 3, *(2 * [image_size or ready.image_size]))
    # Each file is written beside its target and renamed into place: a refused write leaves the old file or none.
    if fmt == "state_dict":
        atomic_write(target, lambda file: torch.save(net.state_dict(), file))
    elif fmt == "torchscript":
        with warnings.catch_warnings():
            # torch says TorchScript is deprecated on every script() call; docs/security.md recommends ONNX.
            warnings.filterwarnings("ignore", message=r".*torch\.jit\..* is deprecated", category=FutureWarning)
            scripted = torch.jit.script(net)
            atomic_write(target, lambda file: torch.jit.save(scripted, file))
    else:
        program = _onnx_program(net, example)
        atomic_write(target, lambda file: file.write(program.model_proto.SerializeToString()))
    write_class_indices(folder / CLASS_INDICES, class_names)
    return target


def _onnx_program(net: torch.nn.Module, example: torch.Tensor) -> torch.onnx.ONNXProgram:
    # The dynamo exporter (it needs onnxscript): the legacy one rejects AdaptiveAvgPool2d at sizes other than
    # multiples of 6 px of feature map. The batch stays dynamic, the image side is fixed at the example's.
    return torch.onnx.export(
        net, (example,), dynamo=True, input_names=["images"], output_names=["logits"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )


def check_arguments(ckpt_path: str, fmt: str, output: str | None, image_size: int | None) -> Path:
    """Refuse what export cannot do before the checkpoint is read or anything is written; the output folder."""
    if image_size is not None and image_size < MIN_IMAGE_SIZE:
        raise ConfigError(f"--image_size {image_size} is too small for the network's poolings: use at least "
                          f"{MIN_IMAGE_SIZE}, or leave it unset for the side the run evaluated at.")
    checkpoint = inference.resolve(ckpt_path, "--ckpt_path")
    checks.check_regular_file(checkpoint, "--ckpt_path", "a checkpoint written by `fit` "
                              "(runs/flowers/version_N/checkpoints/*.ckpt), or best or last")
    folder = Path(output) if output else checkpoint.parent / "export"
    where = f"--output {str(folder)!r}" if output else f"The export folder {str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        kind = special_kind(folder) or "a file"
        raise ConfigError(f"{where} is {kind}, not a folder: export writes its files into a folder, so name a new "
                          "or empty one.")
    if not can_create(folder):
        raise ConfigError(f"{where} cannot be written (read-only, or no permission): choose another --output.")
    if runs.occupied(folder, folder):
        raise ConfigError(f"{where} holds a run's config or checkpoints, which an export must not write among "
                          "(it writes class_indices.json): choose another --output, e.g. a new folder.")
    for entry in folder.iterdir() if folder.is_dir() else ():
        # Export writes class_indices.json and <network><suffix>: through a link it would write somewhere else,
        # into a FIFO it would block.
        if entry.name == CLASS_INDICES or entry.name.endswith(SUFFIXES[fmt]):
            if kind := "a symbolic link" if entry.is_symlink() else special_kind(entry):
                raise ConfigError(f"{where} holds {entry.name}, {kind}, where export writes a file: remove it or "
                                  "choose another --output.")
            if entry.resolve() == checkpoint.resolve():
                raise ConfigError(f"{where}: the export would overwrite the checkpoint {entry.name} itself; "
                                  "choose another --output.")
    return folder


def main(args: list[str] | None = None) -> int:
    options = parser().parse_args(args)
    try:
        folder = check_arguments(options.ckpt_path, options.format, options.output, options.image_size)
        target = _export_or_clean_up(options, folder)
    except ConfigError as error:
        print(f"flowers export: error: {error}", file=sys.stderr)
        return 2
    print(f"Exported {options.format} to {target} (class mapping beside it in class_indices.json)")
    return 0


def _export_or_clean_up(options: argparse.Namespace, folder: Path) -> Path:
    """``export``, and when the disk refuses a write (full, quota, read-only): one paragraph, and the files and
    folders this export made removed."""
    made = _missing_folders(folder)
    try:
        return export(options.ckpt_path, options.format, options.output, options.image_size)
    except OSError as error:  # atomic_write reports the disk's refusal as the OSError itself, and leaves no part
        for made_folder in made:
            with contextlib.suppress(OSError):
                made_folder.rmdir()
        raise ConfigError(f"could not write the export into {folder} ({error.strerror or error}); no half-written "
                          "file was left. Free space on that disk, or choose another --output.") from None


def _missing_folders(folder: Path) -> list[Path]:
    """The folders that writing into ``folder`` creates, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing
