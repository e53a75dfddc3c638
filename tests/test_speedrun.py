"""configs/speedrun.yaml, shrunk to seconds: last.ckpt holds the averaged weights its figures are for, and an
interrupted run resumes to the same bits as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from flowers.cli import cli_main
from tests.helpers.runs import TINY_RUN

# The recipe as written, on tiny images: progressive resizing from 64 to 80 px, evaluated at 96.
SMALL = [*TINY_RUN, "--budget=null", "--trainer.max_epochs=4", "--trainer.limit_train_batches=3",
         "--trainer.limit_val_batches=2",
         "--data.start_image_size=64", "--data.image_size=80", "--data.eval_image_size=96",
         "--trainer.deterministic=true"]


class StopAfter(L.Callback):
    """Stops a run at the end of training epoch ``epochs`` as if it were killed there (its last.ckpt written)."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def speedrun(folder: Path, monkeypatch, data: Path, *args: str):
    monkeypatch.chdir(folder)
    config = Path(__file__).resolve().parents[1] / "configs" / "speedrun.yaml"
    return cli_main(["fit", f"--config={config}", *SMALL, f"--data.data_dir={data}", *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_synthetic):
    monkeypatch = pytest.MonkeyPatch()
    straight_dir, resumed_dir = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    try:
        straight = speedrun(straight_dir, monkeypatch, tiny_synthetic)
        interrupted = speedrun(resumed_dir, monkeypatch, tiny_synthetic,
                               f"--trainer.callbacks+={__name__}.StopAfter", "--trainer.callbacks.epochs=2")
        assert interrupted.trainer.current_epoch == 2
        resumed = speedrun(resumed_dir, monkeypatch, tiny_synthetic, "--ckpt_path=last")
    finally:
        monkeypatch.undo()
    return straight, resumed, straight_dir, resumed_dir


def last_ckpt(cli, folder: Path) -> Path:
    return folder / cli.trainer.log_dir / "checkpoints" / "last.ckpt"


def saved(cli, folder: Path) -> dict:
    return torch.load(last_ckpt(cli, folder), map_location="cpu", weights_only=True)


def test_last_checkpoint_holds_the_moving_average_not_the_last_step(runs):
    straight, _, folder, _ = runs
    checkpoint = saved(straight, folder)
    averaged, current = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert set(averaged) == set(current) and any(k.startswith("net.features.0") for k in averaged)
    assert not all(torch.equal(averaged[k], current[k]) for k in averaged)
    # What the run ends with is the average (Lightning's WeightAveraging copies it in at the end).
    for key, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, averaged[key]), key


def test_validating_last_checkpoint_scores_what_the_run_logged(runs, monkeypatch):
    straight, _, folder, _ = runs
    monkeypatch.chdir(folder)
    logged = float(straight.trainer.callback_metrics["val/acc"])
    config = Path(__file__).resolve().parents[1] / "configs" / "speedrun.yaml"
    check = cli_main(["validate", f"--config={config}", *SMALL, f"--data.data_dir={straight.datamodule.data_dir}",
                      f"--ckpt_path={last_ckpt(straight, folder)}"])
    assert float(check.trainer.callback_metrics["val/acc"]) == pytest.approx(logged, abs=1e-6)


def test_an_interrupted_speedrun_resumes_to_the_same_bits(runs):
    straight, resumed, straight_dir, resumed_dir = runs
    assert resumed.trainer.current_epoch == straight.trainer.current_epoch == 4
    expected, got = saved(straight, straight_dir), saved(resumed, resumed_dir)
    for part in ("state_dict", "current_model_state"):  # the average and the weights it averages
        assert list(got[part]) == list(expected[part])
        for key, tensor in expected[part].items():
            assert torch.equal(got[part][key], tensor), (part, key)


def test_predict_with_the_recipe_and_last_checkpoint_needs_no_training_folder(runs, monkeypatch, tmp_path):
    # The recipe names data/flower_photos, absent here: predict takes the classes from the checkpoint.
    straight, _, folder, _ = runs
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "speedrun.yaml"
    images = straight.datamodule.data_dir / straight.datamodule.class_names[0]
    cli = cli_main(["predict", f"--config={config}", *SMALL, f"--ckpt_path={last_ckpt(straight, folder)}",
                    f"--data.predict_dir={images}"])
    rows = (Path(cli.trainer.log_dir) / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + len(list(images.iterdir()))


def test_weight_averaging_copies_the_module_but_shares_its_factories():
    # Under ddp the command line's optimizer partial reaches objects holding thread locks, which cannot be copied.
    import copy
    import functools
    import threading

    from flowers.module import FlowerClassifier

    def adamw(params, **_):
        return torch.optim.AdamW(params, lr=1e-3)

    factory = functools.partial(adamw)
    model = FlowerClassifier(5, optimizer=factory)
    factory.keywords["lock"] = threading.Lock()  # what the factory reaches once the run has started
    duplicate = copy.deepcopy(model)
    assert duplicate.optimizer_factory is model.optimizer_factory
    assert duplicate.net.features[0].weight is not model.net.features[0].weight
    assert torch.equal(duplicate.net.features[0].weight, model.net.features[0].weight)
    assert duplicate.class_names == model.class_names and duplicate.class_names is not model.class_names
