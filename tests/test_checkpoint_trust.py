"""A checkpoint is untrusted data: every command and API that opens one refuses a file whose settings would
build a class or run a callable, or that is no plain data at all, in one sentence, and writes nothing."""

from __future__ import annotations

import inspect
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from flowers import analysis, checkpoint_reader
from flowers.cli import main as cli_main
from flowers.errors import ConfigError
from flowers.export import main as export_main
from flowers.module import FlowerClassifier
from tests.helpers.runs import TINY_RUN, best_checkpoint


def file_handler(marker: Path) -> dict:
    """A class that creates ``marker`` when built: the proof that a checkpoint ran code."""
    return {"class_path": "logging.FileHandler", "init_args": {"filename": str(marker)}}


# Where a payload can sit in a checkpoint's hyper_parameters, and the key the refusal must name.
PAYLOADS = {
    "the optimizer itself": (lambda h, p: h.update(optimizer=p), "'optimizer'"),
    "an optimizer's argument": (lambda h, p: h["optimizer"]["init_args"].update(lr=p), "'optimizer.init_args.lr'"),
    "a scheduler's argument": (lambda h, p: h.update(scheduler={
        "class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau", "init_args": {"mode": p}}),
        "'scheduler.init_args.mode'"),
    "the base Optimizer's untyped defaults": (lambda h, p: h.update(optimizer={
        "class_path": "torch.optim.Optimizer", "init_args": {"defaults": p}}), "'optimizer'"),
    "a callable argument": (lambda h, p: h.update(scheduler={
        "class_path": "torch.optim.lr_scheduler.CyclicLR",
        "init_args": {"base_lr": 0.1, "max_lr": 0.2, "scale_fn": "os.getcwd"}}), "'scheduler.init_args.scale_fn'"),
    "a plain setting": (lambda h, p: h.update(weights=p), "'weights'"),
    "a list item": (lambda h, p: h.update(mean=[0.5, p, 0.5]), "'mean[1]'"),
    "an unknown setting": (lambda h, p: h.update(callback=p), "'callback'"),
    "another instantiator": (lambda h, p: h.update(_instantiator="os.system"), "'_instantiator'"),
    "another model class": (lambda h, p: h.update(_class_path="logging.FileHandler"), "'_class_path'"),
    "a string where a callable goes": (lambda h, p: h.update(optimizer="os.getcwd"), "'optimizer'"),
}


@pytest.fixture(scope="module")
def genuine(trained_run) -> Path:
    return best_checkpoint(trained_run)


def hostile_copy(genuine: Path, folder: Path, where: str, marker: Path) -> Path:
    checkpoint = torch.load(genuine, weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    hparams["optimizer"] = {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.001}}
    PAYLOADS[where][0](hparams, file_handler(marker))
    path = folder / "hostile.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("where", list(PAYLOADS))
def test_the_reader_refuses_every_place_a_payload_can_hide(where, genuine, tmp_path):
    marker = tmp_path / "created-by-the-checkpoint"
    hostile = hostile_copy(genuine, tmp_path, where, marker)
    with pytest.raises(ConfigError, match=re.escape("is refused: its hyper_parameters key " + PAYLOADS[where][1])):
        checkpoint_reader.read(hostile, model_class=FlowerClassifier)
    assert not marker.exists()


def test_every_setting_fit_writes_passes_the_reader(genuine):
    checkpoint = checkpoint_reader.read(genuine, model_class=FlowerClassifier)
    for name in ("torch.optim.SGD", "torch.optim.AdamW", "torch.optim.lr_scheduler.OneCycleLR",
                 "flowers.schedules.WarmupCosineLR", "flowers.module.WarmupCosineLR"):
        assert name in checkpoint_reader.allowed_classes()
    assert checkpoint["hyper_parameters"]["class_names"] == ["daisy", "dandelion", "rose", "sunflower", "tulip"]


def test_the_arguments_fit_records_for_every_allowed_class_pass(genuine):
    # LightningCLI records every argument of the optimizer and scheduler, defaults included.
    for path, cls in checkpoint_reader.allowed_classes().items():
        arguments = {name: parameter.default for name, parameter in inspect.signature(cls).parameters.items()
                     if parameter.default is not inspect.Parameter.empty and
                     isinstance(parameter.default, int | float | str | bool | tuple | type(None))}
        key = "optimizer" if issubclass(cls, torch.optim.Optimizer) else "scheduler"
        checkpoint_reader.check_hyper_parameters({key: {"class_path": path, "init_args": arguments}},
                                                 FlowerClassifier, "a checkpoint")


def entry_points(ckpt: str, data: Path, port: int) -> dict:
    """Each way a checkpoint is opened, as a call that returns the exit code or raises ConfigError."""
    return {
        "fit --ckpt_path": lambda: cli_main(["fit", *TINY_RUN, f"--data.data_dir={data}", f"--ckpt_path={ckpt}"]),
        "fit --model.init_from": lambda: cli_main(["fit", *TINY_RUN, f"--data.data_dir={data}",
                                                   f"--model.init_from={ckpt}"]),
        "validate": lambda: cli_main(["validate", *TINY_RUN, f"--data.data_dir={data}", f"--ckpt_path={ckpt}"]),
        "test": lambda: cli_main(["test", *TINY_RUN, f"--data.data_dir={data}", f"--ckpt_path={ckpt}"]),
        "predict": lambda: cli_main(["predict", *TINY_RUN, f"--data.predict_dir={data}", f"--ckpt_path={ckpt}"]),
        "export": lambda: export_main(["--ckpt_path", ckpt, "--format", "state_dict"]),
        "serve": lambda: __import__("flowers.serve", fromlist=["main"]).main(["--ckpt_path", ckpt, "--port",
                                                                            str(port)]),
        "analysis.load": lambda: analysis.load(ckpt),
        "analysis.image_size_of": lambda: analysis.image_size_of(ckpt),
        "FlowerClassifier.load_from_checkpoint": lambda: FlowerClassifier.load_from_checkpoint(ckpt),
    }


ENTRY_POINTS = list(entry_points("", Path(), 0))


def refused(call, capsys) -> str:
    """The one-paragraph refusal of ``call``: exit 2 with ``...: error: ...``, or a ConfigError from the API."""
    try:
        code = call()
    except ConfigError as error:
        return str(error)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and ": error: " in err.strip().splitlines()[-1], err
    return err


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_checkpoint_whose_settings_build_a_class(entry, genuine, tiny_synthetic, in_tmp,
                                                                            capsys):
    marker = in_tmp / "created-by-the-checkpoint"
    hostile = hostile_copy(genuine, in_tmp, "an optimizer's argument", marker)
    before = sorted(os.listdir(in_tmp))
    message = refused(entry_points(str(hostile), tiny_synthetic, 8000 + os.getpid() % 1000)[entry], capsys)
    assert "'optimizer.init_args.lr' names the class 'logging.FileHandler'" in message
    assert not marker.exists()
    assert sorted(os.listdir(in_tmp)) == before, "the refusal wrote something"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def broken_files(folder: Path, genuine: Path, marker: Path) -> dict[str, tuple[Path, str]]:
    folder.mkdir()
    empty = folder / "empty.ckpt"
    empty.touch()
    truncated = folder / "truncated.ckpt"
    truncated.write_bytes(genuine.read_bytes()[:5000])
    pickled = folder / "pickled.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": _Payload(marker)}, pickled)
    fifo = folder / "fifo.ckpt"
    os.mkfifo(fifo)
    foreign = folder / "foreign.ckpt"
    torch.save([1, 2, 3], foreign)
    return {"empty": (empty, r"is empty \(0 bytes\)"), "truncated": (truncated, "truncated or no checkpoint"),
            "pickled code": (pickled, "holds Python objects beyond tensors and plain data"),
            "fifo": (fifo, "not a (regular )?file"), "foreign": (foreign, "is not a flowers checkpoint"),
            "missing": (folder / "missing.ckpt", "does not exist")}


@pytest.mark.parametrize("entry", ["predict", "export", "analysis.load", "FlowerClassifier.load_from_checkpoint"])
def test_broken_and_special_files_get_one_true_sentence(entry, genuine, tiny_synthetic, in_tmp, capsys):
    marker = in_tmp / "created-by-the-pickle"
    for kind, (path, words) in broken_files(in_tmp / "files", genuine, marker).items():
        message = refused(entry_points(str(path), tiny_synthetic, 0)[entry], capsys)
        assert re.search(words, message), (kind, message)
        assert not marker.exists()
    assert not (in_tmp / "runs").exists()


def test_the_refused_names_of_lightning_are_one_sentence(genuine, tiny_synthetic, in_tmp, capsys):
    for name in ("hpc", "registry"):
        message = refused(lambda n=name: cli_main(["validate", *TINY_RUN, f"--data.data_dir={tiny_synthetic}",
                                                   f"--ckpt_path={n}"]), capsys)
        assert "loads only checkpoints it can check first" in message


def test_a_refused_pickle_is_a_pickle_error_in_torch():
    # The reader names a pickle payload by the exception torch raises for it: this breaks loudly if that changes.
    import io

    buffer = io.BytesIO()
    torch.save({"payload": _Payload(Path("/nonexistent/never"))}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buffer, weights_only=True)


def test_load_from_checkpoint_still_loads_a_genuine_checkpoint_with_its_optimizer(genuine, tmp_path):
    copy = shutil.copy(genuine, tmp_path / "genuine.ckpt")
    model = FlowerClassifier.load_from_checkpoint(copy, map_location="cpu")
    assert model.class_names and model.hparams.eval_image_size == 64
