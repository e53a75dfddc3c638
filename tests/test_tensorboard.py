"""TensorBoard extras: confusion-matrix and prediction images, hparams with metrics, and a real server."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from flowers.analysis import read_scalars
from flowers.figures import confusion_matrix_image, prediction_grid


@pytest.fixture
def run_dir(trained_run) -> Path:
    return trained_run


def _events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_each_validation_epoch_logs_a_confusion_matrix_and_a_prediction_grid(run_dir):
    events = _events(run_dir)
    assert {"val/confusion_matrix", "val/predictions"} <= set(events.Tags()["images"])
    # One per epoch (the sanity check logs nothing), at the same steps as val/acc.
    matrices = events.Images("val/confusion_matrix")
    assert [m.step for m in matrices] == [s.step for s in events.Scalars("val/acc")][:2]
    assert matrices[0].width > 5 * 40 and matrices[0].encoded_image_string[:4] == b"\x89PNG"


def test_hparams_are_logged_with_the_final_val_metrics(run_dir):
    events = _events(run_dir)
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metric_tags = {info.name.tag for info in experiment.metric_infos}
    assert {"val/acc", "val/acc_macro", "val/loss", "val/acc_best"} <= metric_tags
    params = {info.name for info in experiment.hparam_infos}
    assert {"num_classes", "label_smoothing", "data/image_size", "data/batch_size"} <= params
    assert "hp_metric" not in events.Tags()["scalars"]  # no -1 placeholder


def test_pictures_are_drawn_from_tensors():
    matrix = torch.tensor([[3, 1], [0, 4]])
    image = confusion_matrix_image(matrix, ["cat", "dog"])
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    grid = prediction_grid(torch.zeros(5, 3, 64, 64), torch.tensor([0, 1, 0, 1, 0]),
                           torch.tensor([[0.9, 0.1]] * 5), ["cat", "dog"], columns=4)
    assert grid.shape[1:] == (2 * (128 + 30), 4 * 128)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_the_tensorboard_server_serves_val_acc(run_dir):
    logdir = run_dir.parents[1]  # runs/, as `make tensorboard` serves it
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    server = subprocess.Popen([str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    run = run_dir.relative_to(logdir).as_posix()
    query = urllib.parse.urlencode({"run": run, "tag": "val/acc"})
    logged = read_scalars(run_dir)["val/acc"]  # one point per epoch, as the event files hold them
    try:
        deadline = time.monotonic() + 90
        points = []
        while time.monotonic() < deadline:
            assert server.poll() is None, "tensorboard exited"
            try:
                tags = _get_json(f"{base}/tags")
                if "val/acc" in tags.get(run, {}):
                    points = _get_json(f"{base}/scalars?{query}")  # [[wall_time, step, value], …]
                    if points:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        # What the server has loaded so far (it reads the event files in the background): the run's own points.
        assert points and [(step, pytest.approx(value)) for _, step, value in points] == logged[:len(points)]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
