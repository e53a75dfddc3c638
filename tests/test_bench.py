"""`python benchmarks/bench.py` runs end to end on tiny data and reports every row (no timings checked)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowers import precision
from tests.helpers.images import make_tree

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
# Tiny images and batches, one floor step, no warm-up: a run takes seconds on CPU.
TINY = ["--image-size", "64", "--batch-size", "4", "--num-workers", "0", "--floor-steps", "1", "--warmup-batches", "0"]


@pytest.fixture(scope="module")
def bench():
    # A script outside the package: loaded from its file, as `python benchmarks/bench.py` runs it.
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_cpu(monkeypatch, tmp_path, flags: str) -> None:
    """This machine's CPU as one with ``flags``, for ``precision: auto``."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse avx2 {flags}\n")
    monkeypatch.setattr(precision, "CPUINFO", cpuinfo)


def test_bench_prints_every_row_and_writes_json(bench, in_tmp, tiny_synthetic, capsys, monkeypatch):
    fake_cpu(monkeypatch, in_tmp, "avx512_bf16")
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "1", "--repeats", "1",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in ("a plain PyTorch loop", "b fit, tutorial settings", "b_cli fit + CLI logger/callbacks",
                "c fit, configs/fast.yaml", "floor: train step on tensors", "loader alone", "cache build"):
        assert row in printed, row
    report = json.loads(out.read_text())
    assert set(report) == {"config", "cache_build_s", "floor", "floor_runs", "loader", "variants"}
    assert list(report["floor"]) == ["fp32", "bf16_channels_last_fused"]  # the floors a, b and c use, no others
    assert all(len(runs) == 1 for runs in report["floor_runs"].values())  # one floor per repeat
    assert set(report["loader"]) == {"pil", "cache"}
    assert list(report["variants"]) == list(bench.VARIANTS)
    for result in report["variants"].values():
        assert len(result["runs"]) == 1 and result["runs"][0]["train_images"] == 4
        assert result["val_acc_mean"] == result["runs"][0]["val_acc"] == result["runs"][0]["history"][-1]["val_acc"]
        assert result["ratio_to_a"] > 0 and result["fraction_of_floor"] > 0
    assert report["config"]["fast_precision"] == "bf16-mixed"  # precision: auto, as `flowers fit` resolves it


def test_without_native_bf16_c_runs_and_is_compared_in_fp32(bench, in_tmp, tiny_synthetic, monkeypatch):
    fake_cpu(monkeypatch, in_tmp, "")
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "1", "--repeats", "1",
                       "--variants", "a,c", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["fast_precision"] == "32-true"
    assert report["variants"]["c"]["runs"][0]["used"]["precision"] == "32-true"
    assert list(report["floor"]) == ["fp32", "fp32_channels_last_fused"]  # no emulated bf16 floor measured


@pytest.mark.slow
def test_bench_trains_several_epochs_and_pairs_the_accuracies_by_seed(bench, in_tmp, tiny_synthetic, capsys):
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "2", "--repeats", "2",
                       "--epochs", "2", "--variants", "a,c", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    order = [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("# repeat")]
    assert order == ["# repeat 1/2 a", "# repeat 1/2 c", "# repeat 1/2 floor",
                     "# repeat 2/2 c", "# repeat 2/2 a", "# repeat 2/2 floor"]  # every other repeat reversed
    assert "img/s after epoch 1" in captured.out and "val acc c − a, paired by seed:" in captured.out
    report = json.loads(out.read_text())
    for result in report["variants"].values():
        assert [run["train_images"] for run in result["runs"]] == [16, 16]  # 2 epochs of 2 batches of 4
        for run in result["runs"]:  # one entry per epoch, the last one the run's final accuracy
            assert len(run["history"]) == 2 and run["history"][-1]["val_acc"] == run["val_acc"]
            assert all(entry["train_loss"] > 0 for entry in run["history"])
            assert [entry["train_images"] for entry in run["history"]] == [8, 8]  # each epoch's own
            assert sum(entry["train_s"] for entry in run["history"]) <= run["train_s"] * 1.001
    assert report["variants"]["c"]["runs"][0]["workers"] == 0  # the cache path on CPU loads in-process


def test_paired_differences_have_a_students_t_interval(bench):
    diff = bench.paired([0.70, 0.72, 0.71], [0.68, 0.69, 0.70])
    assert diff["per_seed"] == [0.02, 0.03, 0.01] and diff["mean"] == pytest.approx(0.02)
    assert diff["half_width"] == pytest.approx(4.303 * 0.01 / 3**0.5)  # t(0.975, 2 degrees of freedom)
    assert bench.paired([0.5], [0.4])["half_width"] is None  # one seed: no interval


def test_accuracy_only_trains_and_scores_without_the_speed_figures(bench, in_tmp, tiny_synthetic, capsys,
                                                                  monkeypatch):
    def not_wanted(*args, **kwargs):
        raise AssertionError("a speed-only measurement ran under --accuracy-only")

    plain_runs = []
    run_plain = bench.run_plain
    monkeypatch.setattr(bench, "loader_alone", not_wanted)
    monkeypatch.setattr(bench, "compute_floor", not_wanted)
    monkeypatch.setattr(bench, "run_plain", lambda *a, **k: plain_runs.append(1) or run_plain(*a, **k))
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--warmup-batches", "2", "--limit-batches", "1",
                       "--repeats", "2", "--variants", "a,c", "--accuracy-only", "--json", str(out)]) == 0
    assert len(plain_runs) == 2  # the repeats, no warm-up run
    assert "floor, loaders alone               not measured (--accuracy-only)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["loader"] is None and report["floor"] == {} and report["config"]["accuracy_only"]
    assert all(result["fraction_of_floor"] is None for result in report["variants"].values())


@pytest.mark.slow
def test_parallel_runs_each_seed_in_a_process_of_its_own(bench, in_tmp, tiny_synthetic, capsys):
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "1", "--repeats", "2",
                       "--variants", "a", "--ablate", "data.cache=false", "--parallel", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["parallel"] == 2 and report["config"]["accuracy_only"]
    assert [len(result["runs"]) for result in report["variants"].values()] == [2, 2]
    assert "val acc c1 − a, paired by seed" in capsys.readouterr().out


def test_the_loader_alone_times_cs_own_data_path_over_an_epoch(bench, in_tmp, tiny_synthetic, monkeypatch):
    from flowers.data import FlowerDataModule

    cropped = []
    on_after = FlowerDataModule.on_after_batch_transfer
    monkeypatch.setattr(FlowerDataModule, "on_after_batch_transfer",
                        lambda self, batch, index: cropped.append(self.channels_last) or on_after(self, batch, index))
    args = bench.parse_args(["--data-dir", str(tiny_synthetic), *TINY])
    figures, detail = bench.loader_alone(args, torch.device("cpu"), in_tmp)
    batches = detail["batches"]
    assert set(figures) == {"pil", "cache"} and min(figures.values()) > 0
    assert detail == {"batches": batches, "cache_path": "cache in host memory, 0 workers, crop on cpu"}
    assert cropped == [True] * (batches + 1)  # c's settings (channels_last from fast.yaml); one untimed batch first
    cropped.clear()
    args = bench.parse_args(["--data-dir", str(tiny_synthetic), *TINY, "--loader-batches", str(2 * batches + 1)])
    assert bench.loader_alone(args, torch.device("cpu"), in_tmp)[1]["batches"] == 2 * batches + 1  # on into epochs
    assert len(cropped) == 2 * batches + 2


@pytest.mark.slow
def test_bench_ablations_run_c_with_the_named_settings_changed(bench, in_tmp, tiny_synthetic, capsys, monkeypatch):
    fake_cpu(monkeypatch, in_tmp, "amx_bf16")
    out = in_tmp / "bench.json"
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "1", "--repeats", "1",
                       "--variants", "c", "--ablate", "model.channels_last=false",
                       "--ablate", "data.cache=false trainer.precision=32-true model.fused_optimizer=false",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "c1 c with model.channels_last=false" in printed
    assert "c2 c with data.cache=false trainer.precision=32-true model.fused_optimizer=false" in printed
    variants = json.loads(out.read_text())["variants"]
    used = {name: result["runs"][0]["used"] for name, result in variants.items()}
    assert used["c"] == {"network": "AlexNet", "precision": "bf16-mixed", "cache": True, "channels_last": True,
                         "data_channels_last": True, "fused_optimizer": True, "eval_batch_size": 128}
    assert used["c1"] == {**used["c"], "channels_last": False, "data_channels_last": False}  # batches follow the model
    assert used["c2"] == {**used["c"], "precision": "32-true", "cache": False, "fused_optimizer": False}


def test_bench_free_network_runs_every_variant_and_the_floor_without_the_alexnet(bench, in_tmp, tiny_synthetic,
                                                                                  capsys, monkeypatch):
    # --network free: the loops' ceilings. No AlexNet may train anywhere, or a figure would include its work.
    out = in_tmp / "bench.json"
    monkeypatch.setattr(bench, "AlexNet", lambda *args, **kwargs: pytest.fail("bench built an AlexNet"))
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--limit-batches", "2", "--repeats", "1",
                       "--variants", "a,b,c", "--network", "free", "--json", str(out)]) == 0
    assert "--network free: every variant and the floor ran a network" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert all(report["variants"][name]["runs"][0]["used"]["network"] == "Sequential" for name in ("b", "c"))
    assert all(result["runs"][0]["train_images"] == 8 for result in report["variants"].values())


@pytest.mark.slow
def test_the_anatomy_gives_each_phase_of_a_training_step(bench, in_tmp, tiny_synthetic, capsys):
    assert bench.main(["--data-dir", str(tiny_synthetic), *TINY, "--variants", "c", "--anatomy", "2",
                       "--warmup-batches", "1"]) == 0
    printed = capsys.readouterr().out
    assert "augmentation (on_after_batch_transfer)" in printed and "the host's time" in printed
    assert "nan" not in printed  # every phase was found among the profiler's actions


def test_bench_refuses_a_missing_data_dir_unknown_variants_and_settings(bench, in_tmp, tiny_synthetic, capsys):
    def refusal(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit:
            bench.main(list(argv))
        assert exit.value.code == 2
        return capsys.readouterr().err

    assert "does not exist" in refusal("--data-dir", str(in_tmp / "nowhere"))
    assert "unknown" in refusal("--data-dir", str(in_tmp), "--variants", "a,z")
    assert "nothing to run" in refusal("--data-dir", str(in_tmp), "--variants", "")
    # A setting `flowers fit` refuses stops the benchmark before any run, with fit's own message.
    assert "model.colour" in refusal("--data-dir", str(tiny_synthetic), *TINY, "--ablate", "model.colour=red")
    assert bench.parse_args(["--data-dir", str(in_tmp), "--variants", "", "--ablate", "data.cache=false"]).variants \
        == ["c1"]  # only the ablation


def test_bench_data_dir_defaults_to_flowers_data_dir(bench, in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("FLOWERS_DATA_DIR", str(in_tmp))
    assert bench.parse_args([]).data_dir == in_tmp
    monkeypatch.delenv("FLOWERS_DATA_DIR")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "'data/flower_photos' does not exist" in capsys.readouterr().err


def test_bench_is_a_script():
    help_text = subprocess.run([sys.executable, "benchmarks/bench.py", "--help"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    assert "--limit-batches" in help_text and "--variants" in help_text


def test_the_tutorial_loop_runs_as_a_whole_process_and_reports_each_epoch(tmp_path):
    for split, count in (("train", 4), ("val", 2)):
        make_tree(tmp_path / split, {"daisy": count, "rose": count})
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tutorial_loop.py"), "--data-dir", str(tmp_path),
                           "--epochs", "2", "--image-size", "64", "--batch-size", "4", "--num-workers", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    epochs = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]
    # The fraction of the 4 validation images it got right, after a step that learned something.
    assert all(e["val_acc"] * 4 == round(e["val_acc"] * 4) and e["train_loss"] > 0 for e in epochs)
    assert 0 < epochs[0]["elapsed_s"] < epochs[1]["elapsed_s"]  # since the process started, imports included
