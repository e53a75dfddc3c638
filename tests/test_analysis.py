"""flowers.analysis: the Python API behind the checkpoint notebook."""

from pathlib import Path

import pytest
import torch

from flowers import analysis
from tests.helpers.images import write_images
from tests.helpers.runs import best_checkpoint

NAMES = ["daisy", "dandelion", "rose", "sunflower", "tulip"]


@pytest.fixture
def run_dir(trained_run) -> Path:
    return trained_run


def test_find_checkpoints_and_the_newest_best(run_dir):
    runs = run_dir.parents[1]
    found = analysis.find_checkpoints(runs)
    assert {p.name for p in found} >= {"last.ckpt"} and len(found) == 2
    assert analysis.newest_best_checkpoint(runs) == best_checkpoint(run_dir)
    assert analysis.run_dir_of(best_checkpoint(run_dir)) == run_dir
    with pytest.raises(FileNotFoundError):
        analysis.newest_best_checkpoint(run_dir / "checkpoints" / "nothing-here")


def test_load_gives_model_class_names_and_hparams(run_dir):
    model, names, hparams = analysis.load(best_checkpoint(run_dir))
    assert names == NAMES and hparams["num_classes"] == 5 and not model.training
    assert analysis.image_size_of(best_checkpoint(run_dir)) == 64  # from the run's config.yaml


def test_evaluate_reproduces_the_logged_val_acc(run_dir, tiny_synthetic):
    ckpt = best_checkpoint(run_dir)
    model, _, _ = analysis.load(ckpt)
    datamodule = analysis.datamodule_for(ckpt, model)
    assert datamodule.data_dir == tiny_synthetic and datamodule.image_size == 64
    result = analysis.evaluate(model, datamodule)
    n = len(result.labels)
    assert result.confusion.shape == (5, 5) and int(result.confusion.sum()) == n == len(result.paths)
    assert result.accuracy == pytest.approx(float(result.confusion.trace()) / n)
    # The file name records the val/acc logged during fit: the same split and transform give the same number.
    logged = float(ckpt.stem.split("val_acc=")[1])
    assert result.accuracy == pytest.approx(logged, abs=1e-4)
    assert result.precision.shape == result.recall.shape == (5,)
    wrong = result.most_confidently_wrong(3)
    assert all(int(result.predicted[i]) != int(result.labels[i]) for i in wrong)
    confidence = result.probs.max(dim=1).values
    assert [float(confidence[i]) for i in wrong] == sorted((float(confidence[i]) for i in wrong), reverse=True)


def test_predict_rows_with_top_k_and_errors(run_dir, tmp_path):
    model, _, _ = analysis.load(best_checkpoint(run_dir))
    good = write_images(tmp_path / "imgs", 2)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    rows = analysis.predict(model, [*good, broken, tmp_path / "missing.png"], top_k=2, image_size=64)
    assert [r["error"] is None for r in rows] == [True, True, False, False]
    first = rows[0]
    assert first["prediction"] == first["top_k"][0]["class"] and len(first["top_k"]) == 2
    assert sum(first["probs"].values()) == pytest.approx(1, abs=1e-5)
    assert rows[3]["prediction"] is None and "missing.png" in rows[3]["error"]


def test_compare_checkpoints_scores_each_one(run_dir):
    rows = analysis.compare_checkpoints(run_dir / "checkpoints")
    assert [r["checkpoint"] for r in rows] == sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    last = next(r for r in rows if r["checkpoint"] == "last.ckpt")
    # last.ckpt is the second epoch's: scored again on the run's split, it gets the accuracy the run logged then.
    assert last["epoch"] == 1
    assert last["val_acc"] == pytest.approx(analysis.read_scalars(run_dir)["val/acc"][-1][1], abs=1e-6)


def test_read_scalars_and_per_epoch_curves(run_dir):
    scalars = analysis.read_scalars(run_dir)
    assert {"val/acc", "train/loss_epoch", "epoch"} <= set(scalars)
    assert [epoch for epoch, _ in analysis.per_epoch(scalars, "val/acc")][:2] == [0, 1]
    assert all(isinstance(v, float) for _, v in scalars["val/loss"])
    assert torch.isfinite(torch.tensor([v for _, v in scalars["train/loss_epoch"]])).all()
