from __future__ import annotations

import importlib.util
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SYNTHETIC_PY = Path(__file__).resolve().parents[1] / "flowers" / "data" / "synthetic.py"

# Small sets keep every test well under a second of drawing.
SMALL = {"per_class": 3, "size": 32}


@pytest.fixture(scope="module")
def synthetic():
    # Imported here, not at module level, so spawned children that import this file stay light (below).
    from flowers.data import synthetic

    return synthetic


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def _siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir() if p.name.startswith(f".{root.name}."))


def test_layout_count_and_marker(synthetic, tmp_path):
    root = synthetic.generate(tmp_path / "flowers", per_class=4, size=40, seed=3)
    assert root == tmp_path / "flowers"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == list(synthetic.CLASS_NAMES)
    for name in synthetic.CLASS_NAMES:
        assert sorted(p.name for p in (root / name).iterdir()) == [f"{i:05d}.png" for i in range(4)]
        with Image.open(root / name / "00000.png") as image:
            assert (image.mode, image.size) == ("RGB", (40, 40))
    marker = json.loads((root / ".synthetic.json").read_text())
    assert marker["per_class"] == 4 and marker["size"] == 40 and marker["seed"] == 3
    assert marker["format_version"] == synthetic.FORMAT_VERSION
    assert _siblings(root) == [".flowers.lock"]  # no temporary folder left behind


def test_same_parameters_give_identical_bytes_in_any_order(synthetic, tmp_path):
    a = _files(synthetic.generate(tmp_path / "a", per_class=4, size=32))
    b = _files(synthetic.generate(tmp_path / "b", per_class=4, size=32))
    assert a == b and len(a) == 20
    # One generator per image: a smaller set is a prefix of the larger one, image for image.
    fewer = _files(synthetic.generate(tmp_path / "c", per_class=2, size=32))
    assert fewer == {k: v for k, v in a.items() if k.endswith(("00000.png", "00001.png"))}
    other_seed = _files(synthetic.generate(tmp_path / "d", per_class=4, size=32, seed=1))
    assert all(other_seed[k] != a[k] for k in a)


def test_ensure_returns_an_existing_set_without_drawing(synthetic, tmp_path, monkeypatch):
    root = synthetic.ensure_synthetic(tmp_path / "flowers", **SMALL)
    before = _files(root)

    def fail(*args, **kwargs):
        raise AssertionError("ensure_synthetic redrew a set that was already there")

    monkeypatch.setattr(synthetic, "_draw_tree", fail)
    assert synthetic.ensure_synthetic(tmp_path / "flowers", **SMALL) == root
    assert _files(root) == before


def test_ensure_redraws_when_the_parameters_change(synthetic, tmp_path):
    root = synthetic.ensure_synthetic(tmp_path / "flowers", per_class=4, size=32)
    synthetic.ensure_synthetic(root, per_class=2, size=48)
    assert len(_files(root)) == 10
    with Image.open(root / "rose" / "00001.png") as image:
        assert image.size == (48, 48)
    assert json.loads((root / ".synthetic.json").read_text())["per_class"] == 2
    assert [name for name in _siblings(root) if not name.endswith(".lock")] == []


def test_a_folder_without_the_marker_is_never_deleted(synthetic, tmp_path):
    root = tmp_path / "photos"
    (root / "daisy").mkdir(parents=True)
    (root / "daisy" / "mine.jpg").write_bytes(b"precious")
    for call in (synthetic.ensure_synthetic, synthetic.generate):
        with pytest.raises(FileExistsError, match="photos"):
            call(root, **SMALL)
    assert (root / "daisy" / "mine.jpg").read_bytes() == b"precious"
    assert sorted(p.name for p in root.rglob("*")) == ["daisy", "mine.jpg"]


def test_an_interrupted_generation_leaves_nothing_behind(synthetic, tmp_path, monkeypatch):
    real_draw, drawn = synthetic.draw_flower, []

    def draw_then_die(*args, **kwargs):
        if len(drawn) == 7:
            raise KeyboardInterrupt
        drawn.append(1)
        return real_draw(*args, **kwargs)

    monkeypatch.setattr(synthetic, "draw_flower", draw_then_die)
    with pytest.raises(KeyboardInterrupt):
        synthetic.generate(tmp_path / "flowers", **SMALL)
    assert [p.name for p in tmp_path.iterdir()] == [".flowers.lock"]  # the lock file stays by design


def test_ensure_clears_the_leftovers_of_a_killed_run(synthetic, tmp_path):
    stale = tmp_path / ".flowers.tmp-999999"
    (stale / "daisy").mkdir(parents=True)
    synthetic.ensure_synthetic(tmp_path / "flowers", **SMALL)
    assert not stale.exists()


def test_bad_arguments_are_refused(synthetic, tmp_path):
    with pytest.raises(ValueError, match="per_class"):
        synthetic.ensure_synthetic(tmp_path / "x", per_class=0)
    with pytest.raises(ValueError, match="label"):
        synthetic.draw_flower(5, np.random.default_rng(0))


def _ensure_in_child(root: str, calls: str) -> None:
    # Loaded from its file: importing flowers.data would pull in Lightning, ~10 s per child here.
    spec = importlib.util.spec_from_file_location("synthetic_in_child", SYNTHETIC_PY)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    draw_tree = module._draw_tree

    def counted(*args, **kwargs):
        with open(calls, "a") as fh:
            fh.write("drawn\n")
        return draw_tree(*args, **kwargs)

    module._draw_tree = counted
    module.ensure_synthetic(root, per_class=20, size=48)


def test_concurrent_callers_draw_the_set_once(synthetic, tmp_path):
    root, calls = tmp_path / "shared" / "flowers", tmp_path / "calls.txt"
    ctx = multiprocessing.get_context("spawn")  # as DDP ranks: separate interpreters, nothing shared
    procs = [ctx.Process(target=_ensure_in_child, args=(str(root), str(calls))) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert calls.read_text() == "drawn\n"
    assert len(_files(root)) == 100
    assert json.loads((root / ".synthetic.json").read_text())["per_class"] == 20
    assert _siblings(root) == [".flowers.lock"]


def _colour_features(synthetic, per_class: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    features, labels = [], []
    for label in range(len(synthetic.CLASS_NAMES)):
        for index in range(per_class):
            image = synthetic.draw_flower(label, synthetic._image_rng(0, label, index), size=size)
            pixels = np.asarray(image, np.float64).reshape(-1, 3) / 255
            features.append(np.r_[pixels.mean(0), pixels.std(0)])
            labels.append(label)
    return np.array(features), np.array(labels)


def _nearest_centroid(x_train, y_train, x_test) -> np.ndarray:
    centroids = np.stack([x_train[y_train == k].mean(0) for k in range(5)])
    return ((x_test[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)


def _softmax_regression(x_train, y_train, x_test, steps: int = 2000) -> np.ndarray:
    x_train, x_test = (np.c_[x, np.ones(len(x))] for x in (x_train, x_test))  # a bias column
    weights, targets = np.zeros((x_train.shape[1], 5)), np.eye(5)[y_train]
    for _ in range(steps):
        logits = x_train @ weights
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        weights -= 0.5 * x_train.T @ (probs - targets) / len(x_train)
    return (x_test @ weights).argmax(1)


def test_colour_statistics_alone_do_not_give_the_class_away(synthetic):
    # If the mean colour told the classes apart, a CNN could score well without learning shapes.
    x, y = _colour_features(synthetic, per_class=200, size=64)
    x = (x - x.mean(0)) / x.std(0)
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[: int(0.8 * len(y))], order[int(0.8 * len(y)) :]
    for columns in (slice(0, 3), slice(0, 6)):  # mean RGB; mean and std of each channel
        for classify in (_nearest_centroid, _softmax_regression):
            predicted = classify(x[train, columns], y[train], x[test, columns])
            accuracy = (predicted == y[test]).mean()
            assert accuracy < 0.6, f"{classify.__name__} on colour features {columns}: {accuracy:.2f}"
