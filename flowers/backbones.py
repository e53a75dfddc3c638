"""The network behind FlowerClassifier: the tutorial's half-width AlexNet or a torchvision classifier by name,
and the pretrained weights it may start from.

Building never reads weights: a network is built at random, and ``load_weights`` fills it when a fit starts,
so predict, export and resume rebuild it from their checkpoint without a download.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchvision import models

from flowers.alexnet import AlexNet
from flowers.data.transforms import TUTORIAL_MEAN, TUTORIAL_STD
from flowers.errors import ConfigError
from flowers.files import special_kind

TUTORIAL_ALEXNET = "tutorial_alexnet"  # not "alexnet": that name is torchvision's full-width model
# torchvision builders whose training forward returns auxiliary outputs as well as the logits.
AUXILIARY_OUTPUTS = {"googlenet", "inception_v3"}


@dataclass(frozen=True)
class Preprocessing:
    """What a network's weights expect of an image: normalisation, and the side they were trained at."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_size: int | None = None


TUTORIAL_PREPROCESSING = Preprocessing(TUTORIAL_MEAN, TUTORIAL_STD)
# Every torchvision classification weight is trained on ImageNet images normalised with these.
IMAGENET_PREPROCESSING = Preprocessing((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def names() -> list[str]:
    """Every backbone ``--model.backbone`` accepts."""
    return [TUTORIAL_ALEXNET, *(n for n in models.list_models(module=models) if n not in AUXILIARY_OUTPUTS)]


def build(name: str, num_classes: int, *, dropout: float = 0.5) -> nn.Module:
    """The network, randomly initialised, with a head for ``num_classes``."""
    if name == TUTORIAL_ALEXNET:
        return AlexNet(num_classes, dropout=dropout)
    if name not in names():
        raise ConfigError(
            f"--model.backbone={name!r} is not a backbone flowers knows. Use {TUTORIAL_ALEXNET!r} (the tutorial's "
            "network) or a torchvision classification model, e.g. resnet18, resnet50, mobilenet_v3_large, "
            "efficientnet_b0, convnext_tiny, vit_b_16 (all: python -c \"import flowers.backbones as b; "
            "print(b.names())\")."
        )
    return models.get_model(name, weights=None, num_classes=num_classes)


def head_name(net: nn.Module) -> str:
    """The name of the layer that outputs the class scores (``fc``, ``classifier.3``, ``heads.head`` …)."""
    last = None
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            last = name
    if last is None:
        raise ConfigError(f"{type(net).__name__} has no Linear or Conv2d layer to use as its classifier head.")
    return last


@functools.cache
def head_key(backbone: str) -> str:
    """The state_dict key of the head's weight (its first dimension is the class count), known without weights."""
    with torch.device("meta"):
        return head_name(build(backbone, 2)) + ".weight"


def head_parameters(net: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(body, head): the network's parameters split at its classifier head."""
    prefix = head_name(net) + "."
    named = list(net.named_parameters())
    return ([p for n, p in named if not n.startswith(prefix)], [p for n, p in named if n.startswith(prefix)])


def _weights_enum(backbone: str, weights: str):
    if backbone == TUTORIAL_ALEXNET:
        raise ConfigError(
            f"--model.weights={weights!r}: torchvision has no weights for {TUTORIAL_ALEXNET}, the tutorial's "
            "half-width network. Pass a state_dict file, --model.init_from another run, or a torchvision backbone."
        )
    available = models.get_model_weights(backbone)
    if weights not in available.__members__:
        raise ConfigError(
            f"--model.weights={weights!r} is neither a file nor one of {backbone}'s torchvision weights "
            f"({', '.join(available.__members__)})."
        )
    return available[weights]


def is_named_weights(weights: str | None) -> bool:
    """``DEFAULT``, ``IMAGENET1K_V1`` …, as opposed to a file."""
    return weights is not None and weights.isidentifier() and not Path(weights).exists()


def preprocessing(backbone: str, weights: str | None) -> Preprocessing:
    """The normalisation (and training side) the weights were made with: torchvision's description of named
    weights (nothing is downloaded), ImageNet's for any other torchvision backbone, the tutorial's for its own."""
    if not is_named_weights(weights):
        return TUTORIAL_PREPROCESSING if backbone == TUTORIAL_ALEXNET else IMAGENET_PREPROCESSING
    preset = _weights_enum(backbone, weights).transforms()
    return Preprocessing(tuple(preset.mean), tuple(preset.std), int(preset.crop_size[0]))


def _read_named(backbone: str, weights: str) -> dict[str, torch.Tensor]:
    enum = _weights_enum(backbone, weights)
    try:
        return enum.get_state_dict(progress=False, map_location="cpu", weights_only=True)
    except OSError as error:  # URLError is an OSError: no network, a proxy, a firewall
        raise ConfigError(
            f"--model.weights={weights}: {backbone}'s weights could not be downloaded from {enum.url} ({error}). "
            f"Download the file where the network allows and put it in {Path(torch.hub.get_dir()) / 'checkpoints'}, "
            "or pass a state_dict file with --model.weights path/to/file.pth."
        ) from None


def network_weights(module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's tensors in a FlowerClassifier's state_dict (its ``net.`` entries), as the network names them."""
    return {k.removeprefix("net."): v for k, v in module_state.items() if k.startswith("net.")}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict file (``torch.save(net.state_dict())``), or the network inside a flowers checkpoint."""
    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"--model.weights {str(path)!r} does not exist: pass a state_dict file, a torchvision "
                          "weights name of the backbone (DEFAULT), or --model.init_from another run's checkpoint.")
    if kind := special_kind(file):  # a FIFO would block torch.load until something writes into it
        raise ConfigError(f"--model.weights {str(path)!r} is {kind}, not a file: pass a state_dict file "
                          "(torch.save(net.state_dict(), 'weights.pth')).")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a foreign or truncated file surfaces as a deep unpickling error
        raise ConfigError(f"--model.weights {str(path)!r} cannot be read as a state_dict file ({error}).") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # a Lightning checkpoint
        state = network_weights(state["state_dict"])
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--model.weights {str(path)!r} holds no state_dict (a mapping of names to tensors).")
    return state


def load_weights(net: nn.Module, backbone: str, weights: str) -> list[str]:
    """Copy ``weights`` (a torchvision weights name or a state_dict file) into ``net``.

    A head of another class count (an ImageNet head of 1000, another run's classes) is left as initialised.
    Returns the names of the head's tensors that were left; raises ConfigError when the file does not fit."""
    state = _read_named(backbone, weights) if is_named_weights(weights) else read_state_dict(weights)
    return load_matching(net, state, what=f"--model.weights {weights}", backbone=backbone)


def load_matching(net: nn.Module, state: dict[str, torch.Tensor], *, what: str, backbone: str) -> list[str]:
    own = net.state_dict()
    head = head_name(net) + "."
    kept_head = check_matching(net, state, what=what, backbone=backbone)
    body = {k: v for k, v in state.items() if k not in kept_head}
    with torch.no_grad():
        for key, value in body.items():
            own[key].copy_(value)
    if kept_head:
        shapes = f"{tuple(state[kept_head[0]].shape)} in the file, {tuple(own[kept_head[0]].shape)} here"
        rank_zero_warn(f"{what}: the classifier head ({head[:-1]}: {shapes}) is for another number of classes; "
                       "it starts from a fresh initialisation, the rest of the network from the weights.",
                       category=UserWarning)
    return kept_head


def check_matching(net: nn.Module, state: dict[str, torch.Tensor], *, what: str, backbone: str) -> list[str]:
    """Raise ConfigError unless ``state`` fits ``net`` but for a head of another class count; that head's tensor
    names. Shapes only: nothing is copied, so a fit can check its weights before it makes its run folder."""
    own = net.state_dict()
    head = head_name(net) + "."
    kept_head = [k for k in own if k.startswith(head) and k in state and state[k].shape != own[k].shape]
    body = {k: v for k, v in state.items() if k not in kept_head}
    missing = [k for k in own if k not in body and k not in kept_head]
    unexpected = [k for k in body if k not in own]
    wrong = [k for k in body if k in own and body[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        sample = ", ".join((missing + unexpected + wrong)[:4])
        raise ConfigError(
            f"{what} does not fit --model.backbone={backbone}: {len(missing)} of its tensors are missing, "
            f"{len(unexpected)} unknown and {len(wrong)} of another shape (e.g. {sample}). Pass weights saved from "
            f"a {backbone}, or the backbone they were saved from."
        )
    return kept_head
