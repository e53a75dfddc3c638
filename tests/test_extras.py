"""configs/extras/*.yaml, each in a tiny real run: Lightning's EMA (resume included), SWA over the run's
tail, early stopping, the CSV next to TensorBoard, the profiler, MLflow and W&B offline; and the per-class scores
and class-balanced prediction grid every run logs. Nothing here reaches the network."""

from __future__ import annotations

import csv
import ipaddress
import socket
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchmetrics.functional.classification import multiclass_precision, multiclass_recall

from flowers import callbacks
from flowers.cli import cli_main
from flowers.errors import ConfigError
from tests.helpers.runs import TINY_RUN

EXTRAS = Path(__file__).resolve().parents[1] / "configs" / "extras"
SMALL = [*TINY_RUN, "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2"]


def extra(name: str) -> str:
    return f"--config={EXTRAS / name}.yaml"


def fit(data: Path, *args: str):
    return cli_main(["fit", *SMALL, f"--data.data_dir={data}", *args])


@pytest.fixture
def no_network(monkeypatch):
    """Refuses, and records, every connection this process tries to an address off the machine."""
    tried = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                local = ipaddress.ip_address(host).is_loopback
            except ValueError:
                local = host == "localhost"
            if not local:
                tried.append(address)
                raise OSError(f"test: no network ({address})")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield tried
    assert not tried, f"tried to reach {tried}"


def state(checkpoint: dict, part: str) -> dict[str, torch.Tensor]:
    return {key: value for key, value in checkpoint[part].items() if key.startswith("net.")}


class WeightsSeen(L.Callback):
    """The weights a resumed run validates first (its sanity check) and trains from."""

    seen: dict = {}

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:  # after EMAWeightAveraging, listed before this, swapped the average in
            WeightsSeen.seen["validated"] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_start(self, trainer, pl_module) -> None:
        WeightsSeen.seen["trained"] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_ema_averages_and_a_resumed_run_goes_on_with_the_same_average(in_tmp, tiny_synthetic):
    first = fit(tiny_synthetic, extra("ema"), "--trainer.num_sanity_val_steps=0")
    last = in_tmp / first.trainer.log_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    average, current = state(saved, "state_dict"), state(saved, "current_model_state")
    assert average and not all(torch.equal(average[k], current[k]) for k in average)
    assert int(saved["averaging_state"]["n_averaged"]) == 1  # 4 steps, an update every 5th from the first

    resumed = fit(tiny_synthetic, extra("ema"), "--ckpt_path=last", "--trainer.max_epochs=2",
                  f"--trainer.callbacks+={__name__}.WeightsSeen")
    assert resumed.trainer.log_dir == first.trainer.log_dir and resumed.trainer.global_step == 8
    # The resumed run validates the saved average and trains on from the saved raw weights, not from the average.
    for key in average:
        assert torch.equal(WeightsSeen.seen["validated"][key], average[key]), key
        assert torch.equal(WeightsSeen.seen["trained"][key], current[key]), key
    after = torch.load(last, map_location="cpu", weights_only=True)
    assert int(after["averaging_state"]["n_averaged"]) == 2  # the same average, updated once more (step 6)


class TailWeights(L.Callback):
    """The weights after each optimizer step, and which weights each validation scored."""

    steps: list = []
    validated: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        TailWeights.steps.append({k: v.clone() for k, v in pl_module.state_dict().items() if k.startswith("net.")})

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        TailWeights.validated.append(pl_module.state_dict()["net.classifier.6.weight"].clone())


def test_swa_averages_the_last_part_of_the_run_and_validates_the_average_only_once_begun(in_tmp, tiny_synthetic):
    TailWeights.steps, TailWeights.validated = [], []
    # 2 epochs of 4 steps: the average starts at step 4 (half of 8), and takes steps 4 and 6 (every 2nd).
    tail = ["--trainer.callbacks.start=0.5", "--trainer.callbacks.every_n_steps=2", "--trainer.num_sanity_val_steps=0"]
    run = fit(tiny_synthetic, extra("swa"), *tail, "--trainer.max_epochs=2",
              f"--trainer.callbacks+={__name__}.TailWeights")
    assert len(TailWeights.steps) == 8
    last_ckpt = in_tmp / run.trainer.log_dir / "checkpoints" / "last.ckpt"
    last = torch.load(last_ckpt, map_location="cpu", weights_only=True)
    assert int(last["averaging_state"]["n_averaged"]) == 2
    for key, value in state(last, "state_dict").items():  # steps 4 and 6 are the 5th and 7th batches' weights
        assert torch.allclose(value, (TailWeights.steps[4][key] + TailWeights.steps[6][key]) / 2), key
    assert torch.equal(state(last, "current_model_state")["net.classifier.6.weight"],
                       TailWeights.steps[7]["net.classifier.6.weight"])
    # Epoch 1 validated its own weights (no average yet); epoch 2 the average.
    assert torch.equal(TailWeights.validated[0], TailWeights.steps[3]["net.classifier.6.weight"])
    assert torch.equal(TailWeights.validated[1], state(last, "state_dict")["net.classifier.6.weight"])

    # Resumed for a third epoch: the saved average of steps 4 and 6 goes on with steps 8 and 10.
    fit(tiny_synthetic, extra("swa"), *tail, "--trainer.max_epochs=3", "--ckpt_path=last")
    after = torch.load(last_ckpt, map_location="cpu", weights_only=True)
    assert int(after["averaging_state"]["n_averaged"]) == 4


def test_swa_beside_another_averaging_or_in_an_endless_run_is_refused_with_a_clear_error():
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import EMAWeightAveraging

    from flowers.averaging import TailAveraging

    tail = TailAveraging()
    with pytest.raises(ConfigError, match="use one"):
        tail.setup(SimpleNamespace(callbacks=[EMAWeightAveraging(), tail]), None, "fit")
    with pytest.raises(ConfigError, match="no planned length"):  # max_epochs=-1 and no max_steps
        tail.on_train_start(SimpleNamespace(estimated_stepping_batches=float("inf")), None)


@pytest.fixture(scope="module")
def composed(tmp_path_factory, tiny_synthetic):
    """One run with csv_logger, profiler and early_stop (stopping at once), resumed once; the prediction grids drawn."""
    folder = tmp_path_factory.mktemp("composed")
    grids = []

    def record(images, labels, probs, names, **kwargs):
        grids.append((images.clone(), labels.clone()))
        return prediction_grid(images, labels, probs, names, **kwargs)

    prediction_grid = callbacks.prediction_grid
    args = [*TINY_RUN, "--trainer.max_epochs=4", "--trainer.limit_train_batches=3", f"--data.data_dir={tiny_synthetic}",
            "--data.val_split=0.5", "--data.eval_batch_size=16",  # 6 validation images a class: the first 16 span 3
            extra("csv_logger"), extra("profiler"), extra("early_stop"),
            "--trainer.callbacks.patience=0", "--trainer.callbacks.min_delta=1.0"]  # no epoch can improve by 1.0
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(callbacks, "prediction_grid", record)
        cli = cli_main(["fit", *args])
        stopped_at = cli.trainer.current_epoch
        resumed = cli_main(["fit", *args, "--ckpt_path=last"])
    return cli, resumed, folder / cli.trainer.log_dir, stopped_at, grids


def test_early_stop_stops_before_max_epochs(composed):
    cli, resumed, _, stopped_at, _ = composed
    assert stopped_at == 2 < cli.trainer.max_epochs  # validated twice, no improvement the second time
    assert resumed.trainer.current_epoch == 3  # the resumed run kept the stopper's state: one epoch, then stop


def test_csv_is_written_next_to_tensorboard_and_a_resume_appends(composed):
    _, resumed, run_dir, _, _ = composed
    assert [p.name for p in run_dir.parent.iterdir()] == [run_dir.name]  # one run folder for both loggers
    assert resumed.trainer.log_dir == str(run_dir.relative_to(run_dir.parents[2]))
    assert list(run_dir.glob("events.out.tfevents.*")) and (run_dir / "checkpoints" / "last.ckpt").is_file()
    with (run_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    validated = [row for row in rows if row.get("val/acc") and row.get("epoch")]  # not the fit-end hparams row
    assert [float(row["epoch"]) for row in validated] == [0, 1, 2]  # two epochs, then the resumed one
    assert all(row["val/precision/daisy"] != "" for row in validated)


def test_profiler_writes_its_report_into_the_run_folder(composed):
    _, _, run_dir, _, _ = composed
    report = (run_dir / "fit-profile.txt").read_text()
    assert "run_training_epoch" in report and "Total" in report


def test_per_class_precision_and_recall_are_logged_each_validation(composed):
    cli, resumed, run_dir, _, _ = composed
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    names = cli.datamodule.class_names
    steps = sorted({s.step for s in events.Scalars("val/acc")})  # fit end logs val/acc again, with the hparams
    for name in names:
        assert [s.step for s in events.Scalars(f"val/precision/{name}")] == steps
        assert [s.step for s in events.Scalars(f"val/recall/{name}")] == steps
    # The last values are torchmetrics' per-class scores of the final weights on the validation split.
    model = resumed.model.eval()
    with torch.no_grad():
        preds, target = zip(*[(model.eval_logits(x).argmax(1), y) for x, y in resumed.datamodule.val_dataloader()],
                            strict=True)
    preds, target = torch.cat(preds), torch.cat(target)
    for score, metric in (("precision", multiclass_precision), ("recall", multiclass_recall)):
        expected = metric(preds, target, num_classes=len(names), average=None)
        logged = [events.Scalars(f"val/{score}/{name}")[-1].value for name in names]
        assert logged == pytest.approx(expected.tolist(), abs=1e-6), score
    assert not any("val/precision/" in k for k in events.Tags()["tensors"])  # kept out of the HPARAMS tab


def test_prediction_grid_shows_the_same_images_of_every_class_each_epoch(composed):
    cli, _, _, _, grids = composed
    assert len(grids) == 3  # one a validation epoch
    for images, labels in grids:
        assert labels.tolist() == [c for c in range(5) for _ in range(3)]  # 16 // 5 = 3 a class, a row each
        assert torch.equal(images, grids[0][0])


def test_class_counts_are_logged_at_setup(composed):
    cli, _, run_dir, _, _ = composed
    counts = cli.datamodule.class_counts()
    assert counts["train"] == counts["val"] == dict.fromkeys(cli.datamodule.class_names, 6)
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("data/class_counts/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| daisy | 6 | 6 |" in text


def test_mlflow_logs_into_a_local_store(in_tmp, tiny_synthetic, no_network, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra: pip install -e '.[mlflow]'")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    cli = fit(tiny_synthetic, extra("mlflow"), "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0")
    assert cli.trainer.log_dir == "runs/flowers/version_0" and (in_tmp / "runs/flowers/version_0/checkpoints").is_dir()
    client = mlflow.MlflowClient(tracking_uri="sqlite:///runs/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("flowers").experiment_id])
    assert run.data.metrics["val/acc"] == pytest.approx(float(cli.trainer.callback_metrics["val/acc"]))
    assert run.data.params["num_classes"] == "5"
    # With a list of loggers, a resume still goes on in its own run folder.
    resumed = fit(tiny_synthetic, extra("mlflow"), "--trainer.limit_val_batches=1", "--trainer.max_epochs=2",
                  "--ckpt_path=last")
    assert resumed.trainer.log_dir == "runs/flowers/version_0" and resumed.trainer.global_step == 8


def test_wandb_logs_offline_and_sends_nothing(in_tmp, tiny_synthetic, no_network, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="needs the wandb extra: pip install -e '.[wandb]'")
    for key, value in {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_SILENT": "true",
                       "WANDB_CONFIG_DIR": str(in_tmp / "wandb-config"), "WANDB_CACHE_DIR": str(in_tmp / "wandb-cache"),
                       "WANDB_DATA_DIR": str(in_tmp / "wandb-data")}.items():
        monkeypatch.setenv(key, value)  # offline twice over, and an unused local port should anything still try
    try:
        cli = fit(tiny_synthetic, extra("wandb"), "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0")
        assert cli.trainer.log_dir == "runs/flowers/version_0"
        assert wandb.run is not None and wandb.run.offline
        logged = dict(wandb.run.summary)
    finally:
        wandb.finish()
    assert logged["val/acc"] == pytest.approx(float(cli.trainer.callback_metrics["val/acc"]))
    (offline_run,) = (in_tmp / "runs" / "wandb").glob("offline-run-*")
    assert list(offline_run.glob("run-*.wandb")) and not list((in_tmp / "runs" / "wandb").glob("run-*"))
