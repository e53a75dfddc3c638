"""End to end through the CLI: fit → validate → test → predict on a tiny set, in-process, and the installed command."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from flowers.analysis import read_scalars
from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.module import FlowerClassifier
from flowers.runs import last_checkpoint
from tests.helpers.images import make_tree
from tests.helpers.runs import TINY_RUN, best_checkpoint

NAMES = ["daisy", "dandelion", "rose", "sunflower", "tulip"]


def test_fit_writes_checkpoints_class_indices_config_and_logs(trained_run):
    run_dir = trained_run  # a 2-epoch fit of the synthetic set, started in an empty folder
    assert run_dir.parts[-4:-1] == (run_dir.parents[2].name, "runs", "flowers") and run_dir.name == "version_0"
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    assert len(list(checkpoints.glob("best-epoch=*-val_acc=*.ckpt"))) == 1
    assert json.loads((checkpoints / "class_indices.json").read_text()) == {
        "0": "daisy", "1": "dandelion", "2": "rose", "3": "sunflower", "4": "tulip"
    }
    assert (run_dir / "config.yaml").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))
    logged = read_scalars(run_dir)
    for key in ("train/loss_epoch", "val/loss", "val/acc", "val/acc_macro", "train/acc"):
        assert len({step for step, _ in logged[key]}) == 2, key  # at each epoch's end


def test_checkpoint_loads_without_arguments_and_knows_class_names(trained_run):
    best = best_checkpoint(trained_run)
    model = FlowerClassifier.load_from_checkpoint(best, map_location="cpu")
    assert model.class_names == NAMES
    assert model.hparams.optimizer is None or "class_path" in model.hparams.optimizer
    # Checkpoints hold no pickled objects: they load with weights_only=True.
    torch.load(best, map_location="cpu", weights_only=True)


def test_validate_then_predict_from_the_checkpoint(trained_run, tiny_synthetic, in_tmp):
    best = best_checkpoint(trained_run)
    validated = cli_main(["validate", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", f"--ckpt_path={best}"])
    # The same split and weights as the epoch that saved it: the accuracy its file name records.
    saved = float(best.stem.split("val_acc=")[1])
    assert float(validated.trainer.callback_metrics["val/acc"]) == pytest.approx(saved, abs=1e-4)

    # predict needs no training data: the class names come from the checkpoint.
    predict_dir = make_tree(Path("to_predict"), {"some": 3, "more": 2})
    predicted = cli_main(["predict", *TINY_RUN, f"--ckpt_path={best}", f"--data.predict_dir={predict_dir}"])
    out = Path(predicted.trainer.log_dir) / "predictions.csv"
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 5
    names = NAMES
    assert list(rows[0])[:7] == ["path", "prediction", *names]  # then top-k columns and error (test_predict.py)
    for row in rows:
        probs = [float(row[n]) for n in names]
        assert abs(sum(probs) - 1) < 1e-4
        assert row["prediction"] == names[max(range(5), key=probs.__getitem__)]


def test_the_tutorial_layout_with_train_val_and_test_folders(in_tmp):
    for split, count in (("train", 6), ("val", 3), ("test", 3)):
        make_tree(in_tmp / "splitlayout" / split, {"cat": count, "dog": count})
    cli = cli_main(["fit", *TINY_RUN, "--data.data_dir=splitlayout"])
    assert cli.model.class_names == ["cat", "dog"]
    assert cli.model.net.classifier[-1].out_features == 2
    assert len(cli.datamodule.train_set) == 12 and len(cli.datamodule.val_set) == 6
    tested = cli_main(["test", *TINY_RUN, "--data.data_dir=splitlayout",
                       f"--ckpt_path={last_checkpoint(cli.trainer)}"])
    assert "test/acc" in tested.trainer.callback_metrics
    # Each command built the parser of its own subcommand only.
    assert list(cli.subcommands()) == ["fit"] and list(tested.subcommands()) == ["test"]


def test_optimizer_and_scheduler_come_from_yaml(in_tmp, tiny_synthetic):
    Path("exp.yaml").write_text(
        "model:\n"
        "  label_smoothing: 0.1\n"
        "  optimizer:\n    class_path: torch.optim.SGD\n    init_args: {lr: 0.01, momentum: 0.9}\n"
        "  scheduler:\n    class_path: torch.optim.lr_scheduler.StepLR\n    init_args: {step_size: 1, gamma: 0.5}\n"
    )
    cli = cli_main(["fit", *TINY_RUN, "--config=exp.yaml", f"--data.data_dir={tiny_synthetic}",
                    "--trainer.max_epochs=2", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1"])
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)  # two StepLR halvings
    assert cli.model.loss.label_smoothing == 0.1
    # The optimizer is recorded in the checkpoint as data, not as a pickled callable.
    hparams = torch.load(last_checkpoint(cli.trainer), weights_only=True)["hyper_parameters"]
    assert hparams["optimizer"]["class_path"] == "torch.optim.SGD"


class _EpochRecorder(L.Callback):
    """Each training batch's loss, size and correct count, from the logits the module scored."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[float, int, int]]] = []
        self.logged: list[dict[str, float]] = []
        self._logits = None

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.net.register_forward_hook(lambda module, args, output: setattr(self, "_logits", output.detach()))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            self._read(trainer)
        self.batches.append([])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        labels = batch[1]
        correct = int((self._logits.argmax(1) == labels).sum())
        self.batches[-1].append((float(outputs["loss"]), len(labels), correct))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._read(trainer)

    def _read(self, trainer) -> None:
        self.logged.append({k: float(trainer.callback_metrics[k]) for k in ("train/loss_epoch", "train/acc")})


def test_epoch_training_values_cover_that_epoch_only(tmp_path):
    # The epoch's loss and accuracy are logged once, from metric objects, at the epoch's end: each epoch's
    # must be the mean over its own batches (weighted by their sizes), not carried over from the one before.
    recorder = _EpochRecorder()
    images = make_tree(tmp_path / "data", dict.fromkeys(("a", "b", "c"), 6), size=64)  # 15 to train on, 3 to validate
    data = FlowerDataModule(str(images), image_size=64, batch_size=4, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, limit_val_batches=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
                        default_root_dir=tmp_path)
    trainer.fit(FlowerClassifier(data.num_classes, optimizer=lambda p: torch.optim.SGD(p, lr=0.05)), datamodule=data)
    assert len(recorder.logged) == len(recorder.batches) == 3
    for batches, logged in zip(recorder.batches, recorder.logged, strict=True):
        images = sum(n for _, n, _ in batches)
        assert images == len(data.train_set)  # the last batch is a short one, so the weighting matters
        assert logged["train/loss_epoch"] == pytest.approx(sum(loss * n for loss, n, _ in batches) / images, rel=1e-5)
        assert logged["train/acc"] == pytest.approx(sum(c for _, _, c in batches) / images)
    assert len({round(v["train/loss_epoch"], 6) for v in recorder.logged}) == 3


# -- the command as installed --------------------------------------------------------------------------------------
def test_the_installed_flowers_command_routes_export_and_the_lightning_subcommands(tmp_path):
    command = Path(sys.executable).with_name("flowers")
    if not command.is_file():
        pytest.skip(f"no console script at {command}: flowers is not pip-installed in this environment")
    export = subprocess.run([str(command), "export", "--ckpt_path", str(tmp_path / "no.ckpt")],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 2 and "does not exist" in export.stderr
    fit = subprocess.run([str(command), "fit", "--help"], capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0 and "--data.data_dir" in fit.stdout


@pytest.mark.parametrize("entry", ["console script", "python -m"])
def test_help_lists_every_subcommand_under_the_name_flowers(entry):
    command = [str(Path(sys.executable).with_name("flowers"))] if entry == "console script" else \
        [sys.executable, "-m", "flowers"]
    if not Path(command[0]).is_file():
        pytest.skip(f"no console script at {command[0]}: flowers is not pip-installed in this environment")
    overview = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert overview.returncode == 0 and overview.stdout.startswith("usage: flowers ")
    for subcommand in ("fit", "validate", "test", "predict", "export", "download", "serve", "sweep"):
        assert f"\n    {subcommand} " in overview.stdout, subcommand
    # Each start imports torch (seconds): the console script's subcommands are run by the test above.
    for subcommand in () if entry == "console script" else ("fit", "download"):
        usage = subprocess.run([*command, subcommand, "--help"], capture_output=True, text=True, timeout=120)
        assert usage.returncode == 0 and usage.stdout.startswith("usage: flowers "), usage.stdout[:80]
