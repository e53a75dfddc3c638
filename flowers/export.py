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
import sys
import warnings
from pathlib import Path

import torch

from flowers import backbones
from flowers.analysis import image_size_of, load
from flowers.callbacks import write_class_indices
from flowers.errors import ConfigError
from flowers.runs import CLASS_INDICES

SUFFIXES = {"state_dict": ".pth", "torchscript": ".torchscript.pt", "onnx": ".onnx"}


def filename(backbone: str, fmt: str) -> str:
    """``AlexNet.pth`` for the tutorial's network (the tutorial's own file name), ``resnet18.pth`` …"""
    return ("AlexNet" if backbone == backbones.TUTORIAL_ALEXNET else backbone) + SUFFIXES[fmt]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowers export", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--ckpt_path", required=True, help="a checkpoint written by `fit`")
    p.add_argument("--format", choices=sorted(SUFFIXES), default="state_dict")
    p.add_argument("--output", help="folder for the exported files (default: <checkpoint folder>/export)")
    p.add_argument("--image_size", type=int,
                   help="side of the example input for tracing (default: the size the run evaluated at, "
                        "data.eval_image_size or data.image_size; else 224)")
    return p


def export(ckpt_path: str | Path, fmt: str, output: str | Path | None = None, image_size: int | None = None) -> Path:
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise ConfigError(f"--ckpt_path {str(ckpt_path)!r} does not exist.")
    model, class_names, hparams = load(ckpt_path)
    net = model.net.eval()
    folder = Path(output) if output else ckpt_path.parent / "export"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / filename(hparams.get("backbone", backbones.TUTORIAL_ALEXNET), fmt)
    example = torch.randn(2, 3, *(2 * [image_size or image_size_of(ckpt_path)]))
    if fmt == "state_dict":
        torch.save(net.state_dict(), target)
    elif fmt == "torchscript":
        with warnings.catch_warnings():
            # torch says TorchScript is deprecated on every script() call; docs/security.md recommends ONNX.
            warnings.filterwarnings("ignore", message=r".*torch\.jit\..* is deprecated", category=FutureWarning)
            torch.jit.save(torch.jit.script(net), str(target))
    else:
        _export_onnx(net, example, target)
    write_class_indices(folder / CLASS_INDICES, class_names)
    return target


def _export_onnx(net: torch.nn.Module, example: torch.Tensor, target: Path) -> None:
    # The dynamo exporter (it needs onnxscript): the legacy one rejects AdaptiveAvgPool2d at sizes other than
    # multiples of 6 px of feature map. The batch stays dynamic, the image side is fixed at the example's.
    torch.onnx.export(
        net, (example,), str(target), dynamo=True, external_data=False, input_names=["images"],
        output_names=["logits"], dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )


def main(args: list[str] | None = None) -> int:
    options = parser().parse_args(args)
    try:
        target = export(options.ckpt_path, options.format, options.output, options.image_size)
    except ConfigError as error:
        print(f"flowers export: error: {error}", file=sys.stderr)
        return 2
    print(f"Exported {options.format} to {target} (class mapping beside it in class_indices.json)")
    return 0
