"""benchmarks/gpu/run_all.sh: every GPU check's real code runs on the CPU (``--smoke``), a failing or timed-out
step makes the script fail, and the helpers judge what they report (no timings checked)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
RUN_ALL = GPU / "run_all.sh"
TITLES = ("equivalence", "step anatomy", "throughput", "accuracy", "modes")
STEPS = ("env", "equivalence", "throughput", "modes", "accuracy", "anatomy", "ceiling", "tta")


def run_all(tmp_path: Path, *args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("STEPS", "DATA", "RESULTS", "WORK")}
    environment.update(PYTHON=sys.executable, RESULTS=str(tmp_path / "results"), WORK=str(tmp_path / "work"), **env)
    return subprocess.run(["bash", str(RUN_ALL), *args], env=environment, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def steps_file(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "results" / "steps.tsv").read_text().splitlines()
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines}


def helper(name: str, monkeypatch):
    """A helper script beside run_all.sh, loaded from its file (it imports its neighbours by name)."""
    monkeypatch.syspath_prepend(str(GPU))
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_runs_every_step_and_prints_the_five_tables(tmp_path):
    # About two minutes on 2 cores: some 16 processes, each importing torch and Lightning.
    done = run_all(tmp_path, "--smoke", timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = done.stdout[done.stdout.rindex("==== equivalence ===="):]  # the summary at the end
    for title in TITLES:
        assert f"==== {title} ====" in report, title
    assert steps_file(tmp_path) == dict.fromkeys(STEPS, "ok")
    results = tmp_path / "results"
    for step in STEPS:
        assert (results / f"{step}.txt").stat().st_size > 0, step
        assert json.loads((results / f"{step}.json").read_text()), step
    equivalence = json.loads((results / "equivalence.json").read_text())
    assert equivalence["boxes_agree"] and equivalence["sync_check"]["status"] == "n/a (CPU)"
    assert all(0 <= row["mean_abs"] <= row["max_abs"] for row in equivalence["rows"])
    accuracy = json.loads((results / "accuracy.json").read_text())
    assert accuracy["seeds"] == [0, 1] and not accuracy["failed"]
    assert all(len(accuracy["accuracy"][v]) == 2 for v in ("a", "c", "c_pil"))
    assert [d["name"] for d in accuracy["differences"]] == ["c − a", "c_pil − a", "c − c_pil"]
    modes = json.loads((results / "modes.json").read_text())
    assert [row["mode"] for row in modes["rows"]] == ["cpu-fast", "ddp-cpu", "dp-cpu", "deterministic-64"]
    assert all(row["result"] == "ok" for row in modes["rows"])
    assert {row["strategy"] for row in modes["rows"]} == {"SingleDeviceStrategy", "DDPStrategy", "DataParallelStrategy"}
    throughput = json.loads((results / "throughput.json").read_text())
    assert set(throughput["bench"]["variants"]) == {"a", "c"}  # no CUDA graphs on the CPU
    assert "n/a (CPU)" in report
    anatomy = json.loads((results / "anatomy.json").read_text())
    assert set(anatomy["runs"]) == {"c", "b"} and anatomy["runs"]["c"]["synced"] is None


def test_a_step_that_runs_out_of_time_fails_the_script_and_the_others_still_report(tmp_path):
    done = run_all(tmp_path, "--smoke", STEPS="env equivalence", EQUIVALENCE_S="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert steps_file(tmp_path) == {"env": "ok", "equivalence": "timed out after 1s"}
    assert "(no results: equivalence timed out after 1s; see equivalence.txt)" in done.stdout
    assert "(not run: accuracy is not in STEPS)" in done.stdout
    for title in TITLES:
        assert f"==== {title} ====" in done.stdout
    assert (tmp_path / "results" / "equivalence.txt").is_file()
    assert json.loads((tmp_path / "results" / "env.json").read_text())["versions"]["torch"]
    assert "failed: equivalence" in done.stderr


def test_a_step_that_fails_fails_the_script(tmp_path):
    done = run_all(tmp_path, STEPS="ceiling", DATA=str(tmp_path / "nowhere"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert steps_file(tmp_path) == {"ceiling": "failed (exit 2)"}
    assert "does not exist" in (tmp_path / "results" / "ceiling.txt").read_text()


def test_unknown_steps_and_arguments_are_refused(tmp_path):
    done = run_all(tmp_path, STEPS="env bench")
    assert done.returncode == 2 and "unknown step bench" in done.stderr
    done = run_all(tmp_path, "--smok")
    assert done.returncode == 2 and "unknown argument --smok" in done.stderr
    assert "--smoke" in run_all(tmp_path, "--help").stdout


def test_paired_differences_have_a_students_t_interval(monkeypatch):
    accuracy = helper("accuracy", monkeypatch)
    c = {"0": 0.70, "1": 0.72, "2": 0.71, "3": 0.69}
    a = {"0": 0.68, "1": 0.69, "2": 0.70, "4": 0.75}  # seed 3 has no a, seed 4 no c: left out
    diff = accuracy.paired(c, a, "c − a")
    assert diff["per_seed"] == {"0": 0.02, "1": 0.03, "2": 0.01} and diff["n"] == 3
    assert diff["mean"] == pytest.approx(0.02) and diff["sd"] == pytest.approx(0.01)
    assert diff["half_width"] == pytest.approx(4.303 * 0.01 / 3**0.5)  # t(0.975, 2 degrees of freedom)
    assert diff["low"] < 0 < diff["high"]  # three seeds do not settle a 2-point gap this noisy
    assert accuracy.paired({"0": 0.5}, {"0": 0.4}, "x")["half_width"] is None  # one seed: no interval
    assert accuracy.t_quantile(7) == 2.365 and accuracy.t_quantile(100) == 1.96
    assert accuracy.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]


def test_the_modes_table_judges_each_row_and_an_expected_refusal(tmp_path, monkeypatch, capsys):
    modes = helper("modes", monkeypatch)

    def mode(name: str, status: int | None, log: str = "", expect: str = "ok", keys: list[str] | None = None):
        with open(tmp_path / "modes.order", "a") as order:
            order.write(name + "\n")
        (tmp_path / f"{name}.expect").write_text(expect)
        (tmp_path / f"{name}.log").write_text(log)
        if status is not None:
            (tmp_path / f"{name}.status").write_text(str(status))
        if keys is not None:
            (tmp_path / name).mkdir()
            (tmp_path / name / "throughput.json").write_text(json.dumps({
                "strategy": "SingleDeviceStrategy", "world_size": 1, "devices": 1, "precision": "bf16-mixed",
                "replica_dtypes": ["torch.bfloat16"], "images_per_s": 100.0, "val_acc": 0.5, "checkpoint_keys": keys}))

    mode("gpu", 0, keys=["net.a", "net.b"])
    mode("same", 0, keys=["net.a", "net.b"])
    mode("prefixed", 0, keys=["net.module.a", "net.module.b"])
    mode("crashed", 1, log="Traceback (most recent call last):\nRuntimeError: boom")
    mode("refused", 2, log="flowers: error: strategy=dp cannot run a compiled network (model.compile)",
         expect="refused compile")
    mode("refused-badly", 1, log="Traceback (most recent call last):\nflowers: error: compile",
         expect="refused compile")
    mode("not-refused", 0, keys=["net.a", "net.b"], expect="refused compile")
    mode("killed", None)
    out = tmp_path / "modes.json"
    assert modes.main([str(tmp_path), "--json", str(out), "--skipped", "ddp: needs 2 GPUs"]) == 1
    rows = {row["mode"]: row["result"] for row in json.loads(out.read_text())["rows"]}
    assert rows == {"gpu": "ok", "same": "ok", "prefixed": "FAILED (checkpoint keys)", "crashed": "FAILED (exit 1)",
                    "refused": "refused as expected: strategy=dp cannot run a compiled network (model.compile)",
                    "refused-badly": "refused badly (exit 1, see refused-badly.log)", "not-refused": "NOT refused",
                    "killed": "did not finish"}
    printed = capsys.readouterr().out
    assert "==== modes ====" in printed and "skipped: ddp: needs 2 GPUs" in printed
    assert "--- crashed: the end of" in printed and "RuntimeError: boom" in printed  # a failed mode's log tail
