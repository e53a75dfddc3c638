"""A checkpoint carries what its answers depend on (classes, evaluation side, normalisation, mirror averaging):
predict, validate, analysis, serve and export use it untold, a flag overrides it aloud, and best and last name
the same files everywhere."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from flowers import analysis, inference
from flowers.cli import _warn_overridden_model_flags, cli_main
from flowers.export import export
from flowers.serve.model import Predictor, describe, find_model
from flowers.serve.uploads import decode_upload
from tests.helpers.images import write_images
from tests.helpers.runs import best_checkpoint

# How a run is fitted and then used; none of the commands after the fit names an image size.
QUIET = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
         "--data.num_workers=0"]
RUNS = {"64 px, evaluated at 80 with mirror images": ["--data.image_size=64", "--data.eval_image_size=80",
                                                       "--model.eval_hflip=true"],
        "best.yaml's 192/256": ["--data.image_size=192", "--data.eval_image_size=256"]}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory, tiny_synthetic) -> Path:
    """The folder a one-epoch fit ran in; its run is runs/flowers/version_0 below it."""
    folder = tmp_path_factory.mktemp("fitted")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        cli_main(["fit", *QUIET, *RUNS[request.param], f"--data.data_dir={tiny_synthetic}", "--data.batch_size=8",
                  "--trainer.max_epochs=1", "--trainer.limit_train_batches=3"])
    return folder


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    return write_images(tmp_path_factory.mktemp("photos") / "photos", 6, size=90, seed=3)


@pytest.fixture(scope="module")
def untold(run, photos, tmp_path_factory) -> tuple[dict[str, dict], object]:
    """predict's rows and CLI for the run's checkpoint, with no image size or mirror setting on its command line."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("predicted"))
        return predicted(run, photos)


def last_ckpt(run: Path) -> Path:
    return run / "runs" / "flowers" / "version_0" / "checkpoints" / "last.ckpt"


def predicted(run: Path, photos: list[Path], *args: str) -> tuple[dict[str, dict], object]:
    output = Path("predictions.csv").resolve()
    cli = cli_main(["predict", *QUIET, f"--ckpt_path={last_ckpt(run)}", f"--data.predict_dir={photos[0].parent}",
                    "--predictions.format=json", f"--predictions.output={output}", *args])
    rows = json.loads(output.with_suffix(".json").read_text())
    return {Path(row["path"]).name: row["probs"] for row in rows}, cli


def test_the_checkpoint_records_the_side_its_run_evaluates_at(run):
    hparams = torch.load(last_ckpt(run), weights_only=True)["hyper_parameters"]
    config = yaml.safe_load((last_ckpt(run).parents[1] / "config.yaml").read_text())
    assert hparams["eval_image_size"] == config["data"]["eval_image_size"]


def test_predict_without_a_config_answers_as_analysis_and_serve(run, photos, untold):
    rows, cli = untold
    expected_side = torch.load(last_ckpt(run), weights_only=True)["hyper_parameters"]["eval_image_size"]
    assert cli.datamodule.eval_image_size == expected_side
    model, _, _ = analysis.load(last_ckpt(run))
    by_analysis = {Path(row["path"]).name: row["probs"] for row in analysis.predict(model, photos)}
    source = describe(last_ckpt(run))
    assert source.image_size == expected_side and source.eval_hflip == model.eval_hflip
    server = Predictor(source)
    for photo in photos:
        square = decode_upload(photo.read_bytes(), source.image_size)
        served = dict(zip(source.classes, server.probabilities(server.tensor(square)[None])[0].tolist(), strict=True))
        for name in source.classes:
            assert rows[photo.name][name] == pytest.approx(by_analysis[photo.name][name], abs=1e-5)
            assert served[name] == pytest.approx(by_analysis[photo.name][name], abs=1e-5)
        top_k = [sorted(probs, key=probs.get, reverse=True)[:3] for probs in
                 (rows[photo.name], by_analysis[photo.name], served)]
        assert top_k[0] == top_k[1] == top_k[2], photo.name


def test_validate_without_a_config_scores_as_analysis_evaluate(run, tiny_synthetic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["validate", *QUIET, f"--ckpt_path={last_ckpt(run)}", f"--data.data_dir={tiny_synthetic}"])
    model, _, _ = analysis.load(last_ckpt(run))
    expected = analysis.evaluate(model, analysis.datamodule_for(last_ckpt(run), model, data_dir=str(tiny_synthetic)))
    assert float(cli.trainer.callback_metrics["val/acc"]) == pytest.approx(expected.accuracy, abs=1e-6)
    assert cli.datamodule.eval_image_size == model.hparams.eval_image_size


def test_a_flag_overrides_the_checkpoint_and_says_so(run, photos, untold, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    saved = torch.load(last_ckpt(run), weights_only=True)["hyper_parameters"]
    with caplog.at_level(logging.INFO):
        rows, cli = predicted(run, photos, "--data.eval_image_size=96",
                              f"--model.eval_hflip={str(not saved['eval_hflip']).lower()}")
    # The numbers change with the side: the agreement of the tests above is not by chance.
    differences = [abs(rows[n][c] - untold[0][n][c]) for n in rows for c in rows[n]]
    assert max(differences) > 1e-4
    assert cli.datamodule.eval_image_size == 96
    assert cli.model.eval_hflip is not saved["eval_hflip"]
    assert f"Evaluating at 96 px as the command says; the checkpoint's run evaluated at {saved['eval_image_size']}" \
        in caplog.text
    assert f"--model.eval_hflip={not saved['eval_hflip']} as the command says" in caplog.text


def test_best_and_last_name_the_same_files_everywhere(trained_run, photos, monkeypatch, tmp_path):
    run = trained_run
    monkeypatch.chdir(run.parents[2])  # where `fit` ran: runs/flowers/version_0 lies below
    expected = {"best": best_checkpoint(run).resolve(), "last": (run / "checkpoints" / "last.ckpt").resolve()}
    for alias in ("best", "last"):
        assert find_model(alias).resolve() == expected[alias]
        assert inference.load(alias).path.resolve() == expected[alias]
        assert export(alias, "state_dict", output=tmp_path / alias).exists()
    cli = cli_main(["predict", *QUIET, "--ckpt_path=best", f"--data.predict_dir={photos[0].parent}",
                    f"--predictions.output={tmp_path / 'predictions.csv'}"])
    assert Path(cli.config.predict.ckpt_path).resolve() == expected["best"]


def test_a_checkpoint_from_before_the_side_was_recorded_uses_its_runs_config(run, tmp_path):
    checkpoint = torch.load(last_ckpt(run), weights_only=True)
    side = checkpoint["hyper_parameters"].pop("eval_image_size")
    old = last_ckpt(run).parent / "old.ckpt"
    torch.save(checkpoint, old)
    try:
        assert analysis.image_size_of(old) == side
        moved = tmp_path / "moved.ckpt"
        old.rename(moved)
        assert analysis.image_size_of(moved) == inference.DEFAULT_IMAGE_SIZE
    finally:
        old.unlink(missing_ok=True)


def test_resuming_with_the_same_settings_warns_of_nothing():
    # The command line parses Adam's betas as a tuple; the checkpoint's YAML-born settings hold a list.
    command = {"optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 5e-4, "betas": (0.9, 0.999)}}}
    saved = {"optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 5e-4, "betas": [0.9, 0.999]}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_overridden_model_flags(command, {"optimizer": None}, saved)
    command["optimizer"]["init_args"]["betas"] = (0.8, 0.999)
    with pytest.warns(UserWarning, match=r"betas=\[0.8, 0.999\] \(the checkpoint.s: \[0.9, 0.999\]\)"):
        _warn_overridden_model_flags(command, {"optimizer": None}, saved)


def test_an_export_is_served_with_the_normalisation_and_side_its_run_applied():
    # An export records nothing but its network: its run's config.yaml says how the run fed it.
    imagenet = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    config = {"data": {"image_size": 160, "eval_image_size": 192, **imagenet},
              "model": {"backbone": "resnet18", "eval_hflip": True}}
    settings = inference.run_settings(config)
    assert settings == {"eval_image_size": 192, "mean": tuple(imagenet["mean"]), "std": tuple(imagenet["std"]),
                        "eval_hflip": True, "backbone": "resnet18"}
    # A config from before the data recorded its normalisation: the model's, else the tutorial's 0.5.
    older = inference.run_settings({"data": {"image_size": 96}, "model": {"init_args": {**imagenet}}})
    assert (older["eval_image_size"], older["mean"]) == (96, tuple(imagenet["mean"]))
    assert inference.run_settings({}) == {"eval_image_size": 224, "mean": (0.5,) * 3, "std": (0.5,) * 3,
                                          "eval_hflip": False, "backbone": "tutorial_alexnet"}
