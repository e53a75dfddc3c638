"""What ``flowers serve`` serves: a checkpoint or an export, with the classes, image size, normalisation and
mirror-image setting its answers depend on, and the forward pass that turns uploads into probabilities.

``describe`` runs in the command's own process and refuses what cannot be served before anything starts;
``Predictor`` runs in the inference worker. Neither needs LitServe.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from flowers.backbones import TUTORIAL_ALEXNET
from flowers.data.transforms import eval_transform
from flowers.errors import ConfigError
from flowers.inference import load, read_run_config, resolve, run_settings
from flowers.module import logits_with_mirror
from flowers.runs import CLASS_INDICES, CONFIG, read_class_indices, run_dir_of

# Suffixes, not file names: exports may be named after their backbone.
FORMATS = {".ckpt": "checkpoint", ".torchscript.pt": "torchscript", ".onnx": "onnx"}
KIND_NAMES = {"checkpoint": "a checkpoint", "torchscript": "a TorchScript export", "onnx": "an ONNX export"}


@dataclass(frozen=True)
class ModelSource:
    """Everything the worker and ``/info`` need to know, as plain values (it crosses process boundaries)."""

    path: str
    format: str  # checkpoint, torchscript or onnx
    classes: tuple[str, ...]
    image_size: int
    eval_hflip: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    backbone: str
    config: str | None  # the run's config.yaml the settings came from, if any

    def info(self) -> dict:
        described = asdict(self)
        described["classes"] = list(self.classes)
        described["checkpoint"] = described.pop("path")
        described["normalization"] = {"mean": list(described.pop("mean")), "std": list(described.pop("std"))}
        return described


def format_of(path: Path) -> str | None:
    return next((kind for suffix, kind in FORMATS.items() if path.name.endswith(suffix)), None)


def find_model(path: str | Path) -> Path:
    """The file to serve: ``path`` itself, or in an export folder its one ``.onnx`` (else ``.torchscript.pt``);
    ``best`` and ``last`` are the newest run's best and last checkpoints under ``runs/``."""
    path = resolve(path)
    if not path.exists():
        raise ConfigError(f"--ckpt_path {str(path)!r} does not exist.")
    if path.is_file():
        return path
    for suffix in (".onnx", ".torchscript.pt"):
        found = sorted(path.glob(f"*{suffix}"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ConfigError(f"--ckpt_path {str(path)!r} holds {len(found)} {suffix} files "
                              f"({', '.join(p.name for p in found)}): pass the one to serve.")
    raise ConfigError(f"--ckpt_path {str(path)!r} is a folder with no .onnx or .torchscript.pt export in it: "
                      "pass a checkpoint (.ckpt) or an export file.")


def run_config_near(path: Path, kind: str) -> Path | None:
    """The run's ``config.yaml``: a checkpoint's run folder's, as ``predict`` reads it; for an export, the one
    beside it, else that of the run whose ``checkpoints/export/`` holds it."""
    if kind == "checkpoint":
        candidates = [run_dir_of(path) / CONFIG]
    else:
        candidates = [path.parent / CONFIG, run_dir_of(path.parent) / CONFIG]
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def describe(path: str | Path, *, image_size: int | None = None, eval_hflip: bool | None = None) -> ModelSource:
    """Loads the checkpoint or export once to check it, and says how to feed it. Raises ConfigError."""
    path = find_model(path)
    kind = format_of(path)
    if kind is None:
        hint = " A state_dict holds no network: serve its checkpoint, or export it to ONNX or TorchScript." \
            if path.suffix == ".pth" else ""
        raise ConfigError(f"--ckpt_path {str(path)!r} is none of {', '.join(FORMATS)}: flowers serve takes a "
                          f"checkpoint written by `fit` or a file written by `flowers export`.{hint}")
    config_path = run_config_near(path, kind)
    try:
        if kind == "checkpoint":
            ready = load(path)  # the checkpoint's own classes, side, normalisation and mirror setting
            classes, size, (mean, std) = ready.classes, image_size or ready.image_size, ready.model.normalisation()
            eval_hflip = ready.eval_hflip if eval_hflip is None else eval_hflip
            backbone = ready.hparams.get("backbone", TUTORIAL_ALEXNET)
        else:
            classes = read_class_indices(path.parent / CLASS_INDICES)
            run = run_settings(read_run_config(config_path) if config_path else {})  # an export records none of it
            size, mean, std, backbone = image_size or run["eval_image_size"], run["mean"], run["std"], run["backbone"]
            eval_hflip = run["eval_hflip"] if eval_hflip is None else eval_hflip
            if kind == "onnx":
                size = _onnx_image_size(path, image_size) or size
            else:
                _load_torchscript(path, "cpu")
    except ConfigError:
        raise
    except ModuleNotFoundError as missing:
        raise ConfigError(f"serving {path.name} needs {missing.name}: pip install {missing.name}.") from None
    except Exception as error:  # torch.load, jit.load and onnxruntime raise many kinds for a file they can't read
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ConfigError(f"--ckpt_path {str(path)!r} could not be loaded as {KIND_NAMES[kind]} "
                          f"({type(error).__name__}: {first_line}).") from None
    return ModelSource(
        path=str(path), format=kind, classes=tuple(classes), image_size=int(size), eval_hflip=bool(eval_hflip),
        mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std), backbone=str(backbone),
        config=str(config_path) if config_path else None,
    )


def _load_torchscript(path: Path, device: str) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # torch says TorchScript is deprecated on every load; the user chose this export, and it still works.
        warnings.filterwarnings("ignore", message=r".*torch\.jit\..* is deprecated", category=FutureWarning)
        return torch.jit.load(str(path), map_location=device)


def _onnx_image_size(path: Path, asked: int | None) -> int | None:
    import onnxruntime as ort

    shape = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0].shape
    side = shape[-1] if len(shape) == 4 and isinstance(shape[-1], int) else None
    if side and asked and asked != side:
        raise ConfigError(f"--image_size {asked} does not fit {path.name}: its input is fixed at {side} px.")
    return side


class Predictor:
    """The forward pass: squares in, class probabilities out, with the mirror-image average when asked."""

    def __init__(self, source: ModelSource, device: str = "cpu") -> None:
        self.source = source
        self.device = torch.device(device)
        if source.format == "checkpoint":
            ready = load(source.path, map_location=str(self.device))
            ready.model.eval_hflip = source.eval_hflip
            self.transform: Callable = ready.transform(source.image_size)
            self._logits = ready.model.eval_logits
            return
        self.transform = eval_transform(crop_size=source.image_size, mean=source.mean, std=source.std)
        if source.format == "torchscript":
            net = _load_torchscript(Path(source.path), str(self.device)).eval()
            self._logits = functools.partial(logits_with_mirror, net) if source.eval_hflip else net
        else:
            net = self._onnx()
            self._logits = functools.partial(logits_with_mirror, net) if source.eval_hflip else net

    def _onnx(self) -> Callable[[torch.Tensor], torch.Tensor]:
        import onnxruntime as ort

        providers = ["CPUExecutionProvider"]
        if self.device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # as many as torch may use here
        session = ort.InferenceSession(self.source.path, options, providers=providers)
        input_name = session.get_inputs()[0].name

        def run(images: torch.Tensor) -> torch.Tensor:
            (logits, *_) = session.run(None, {input_name: images.cpu().numpy()})
            return torch.from_numpy(logits)

        return run

    def tensor(self, square: np.ndarray) -> torch.Tensor:
        return self.transform(Image.fromarray(square, "RGB"))

    @torch.inference_mode()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, classes]`` on the CPU, exactly as ``flowers.analysis.predict`` computes them."""
        return self._logits(images.to(self.device)).float().softmax(dim=1).cpu()

    def top(self, probs: torch.Tensor, k: int) -> dict:
        values, order = probs.topk(min(k, len(self.source.classes)))
        ranked = [{"class": self.source.classes[i], "probability": v}
                  for v, i in zip(values.tolist(), order.tolist(), strict=True)]
        return {"prediction": ranked[0]["class"], "top": ranked}
