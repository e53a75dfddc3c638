"""`python benchmarks/bench.py --tta` times whole processes to each accuracy, beside the tutorial's loop, on one
split."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_FIT = ("--trainer.accelerator=cpu --trainer.devices=1 --trainer.max_epochs=2 --trainer.limit_train_batches=2 "
            "--trainer.limit_val_batches=2 --data.image_size=64 --data.batch_size=4 --data.num_workers=0")
TINY_LOOP = "--epochs 2 --image-size 64 --batch-size 4 --num-workers 0"


@pytest.fixture(scope="module")
def tta():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tta_times_each_recipe_its_ablation_and_the_loop_per_seed(tta, tiny_synthetic, tmp_path, capsys):
    out = tmp_path / "tta.json"
    assert tta.main(["--tta", "--data-dir", str(tiny_synthetic), "--recipe", "configs/quickstart.yaml",
                     "--seed", "3", "--repeats", "1", "--targets", "0.0,1.01", "--fit-args", TINY_FIT,
                     "--loop-args", TINY_LOOP, "--ablate", "trainer.max_epochs=1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tutorial loop (2 epochs)" in printed and "configs/quickstart.yaml" in printed
    assert "[0/1]" in printed  # nobody reaches 1.01: said, not hidden
    assert "warm-up of configs/quickstart.yaml" in printed and "with trainer.max_epochs=1" in printed
    report = json.loads(out.read_text())
    assert report["config"]["train_images"] + report["config"]["val_images"] == 60  # the split, as folders of links
    ablation = "configs/quickstart.yaml with trainer.max_epochs=1"  # the first recipe, the change winning
    assert list(report["recipes"]) == ["configs/quickstart.yaml", ablation, "tutorial loop (2 epochs)"]
    for name, runs in report["recipes"].items():
        assert [run["seed"] for run in runs] == [3], name  # one seed: each is a whole process
        for run in runs:
            assert [e["epoch"] for e in run["epochs"]] == ([1] if name == ablation else [1, 2]), name
            times = [e["time_s"] for e in run["epochs"]]
            assert 0 < times[0] <= times[-1] <= run["total_s"], name  # from the process's start: imports included
            assert all(earlier < later for earlier, later in zip(times, times[1:], strict=False)), name
            assert tta.first_time_at(run, 0.0) == times[0]


def test_a_folder_with_train_and_val_is_used_as_it_is(tta, tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "val" / "a").mkdir(parents=True)
    assert tta.split_folder(tmp_path, tmp_path / "elsewhere") == tmp_path


def test_the_warm_up_validates_its_one_epoch_whatever_the_fit_args_say(tta, tmp_path, monkeypatch):
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    calls = []

    def fake_fit(recipe, data_dir, seed, runs_dir, extra):
        calls.append(extra)
        return {"epochs": [{"epoch": 1, "val_acc": 0.5, "time_s": 1.0}], "total_s": 2.0}

    monkeypatch.setattr(tta, "fit_process", fake_fit)
    assert tta.main(["--tta", "--data-dir", str(tmp_path), "--recipe", "configs/best.yaml", "--repeats", "1",
                     "--no-loop", "--fit-args=--trainer.check_val_every_n_epoch=5"]) == 0
    warm_up, timed = calls
    # Later flags win: a warm-up that never validated would leave no val/acc to read.
    assert warm_up.index("--trainer.check_val_every_n_epoch=1") > warm_up.index("--trainer.check_val_every_n_epoch=5")
    assert timed == ["--trainer.check_val_every_n_epoch=5"]


def test_budgets_are_multiples_of_the_loops_first_time_on_the_same_machine(tta, tmp_path, monkeypatch, capsys):
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    ran = []

    def fake_loop(data_dir, seed, extra):
        ran.append(("loop", seed))
        return {"epochs": [{"epoch": 1, "val_acc": 0.7, "time_s": 190.0}], "total_s": 200.0 + seed}

    def fake_fit(recipe, data_dir, seed, runs_dir, extra):
        budget = next((flag for flag in extra if flag.startswith("--budget=") and flag != "--budget=null"), None)
        ran.append((budget, seed))
        return {"epochs": [{"epoch": 1, "val_acc": 0.8, "time_s": 100.0}], "total_s": 126.0}

    monkeypatch.setattr(tta, "loop_process", fake_loop)
    monkeypatch.setattr(tta, "fit_process", fake_fit)
    assert tta.main(["--tta", "--data-dir", str(tmp_path), "--recipe", "configs/speedrun.yaml", "--repeats", "2",
                     "--budgets", "0.65,2"]) == 0
    timed = ran[2:]  # after the two warm-ups, which run in epochs
    assert ran[:2] == [(None, 0), (None, 0)]
    # The loop runs first, and its first time sets the budgets; seed 1 runs all in the other order.
    assert timed == [("loop", 0), ("--budget=0:02:10", 0), ("--budget=0:06:40", 0),
                     ("--budget=0:06:40", 1), ("--budget=0:02:10", 1), ("loop", 1)]
    printed = capsys.readouterr().out
    assert "configs/speedrun.yaml at 0.65 × the loop" in printed and "0.969 (0.969–0.969)" in printed  # 126 / 130
    assert "budgets: multiples of the tutorial loop's time, 200 s (its first run here)" in printed
    with pytest.raises(SystemExit):
        tta.parse_args(["--tta", "--data-dir", str(tmp_path), "--budgets", "2", "--no-loop"])
    with pytest.raises(SystemExit):  # a folder with earlier runs would be read in their place
        tta.parse_args(["--tta", "--data-dir", str(tmp_path), "--keep-runs", str(tmp_path)])


def test_the_table_gives_medians_with_min_and_max_over_the_seeds(tta):
    def run(seed, acc, reached_at):
        epochs = [{"epoch": 1, "val_acc": 0.5, "time_s": 5.0}, {"epoch": 2, "val_acc": acc, "time_s": reached_at}]
        return {"seed": seed, "epochs": epochs, "total_s": reached_at + 1}

    report = {"config": {"targets": [0.7], "seeds": [0, 1, 2], "train_images": 9, "val_images": 3}, "warm_up_s": {},
              "recipes": {"r": [run(0, 0.71, 10.0), run(1, 0.75, 12.0), run(2, 0.69, 30.0)]}}
    row = next(line for line in tta.tta_table(report).splitlines() if line.startswith("r "))
    assert "0.710 (0.690–0.750)" in row and "11.0 s (10.0–12.0) [2/3]" in row and "13.0 s (11.0–31.0)" in row
