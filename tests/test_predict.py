"""predict: top-k columns, CSV/JSON output, file lists, and unreadable images reported per row."""

import csv
import json
from pathlib import Path

import pytest

from flowers.cli import cli_main, main
from tests.helpers.images import write_images
from tests.helpers.runs import TINY_RUN, best_checkpoint

NAMES = ["daisy", "dandelion", "rose", "sunflower", "tulip"]


@pytest.fixture
def ckpt(trained_run) -> Path:
    return best_checkpoint(trained_run)


def _predict(ckpt: Path, *args: str):
    cli = cli_main(["predict", *TINY_RUN, f"--ckpt_path={ckpt}", *args])
    return Path(cli.trainer.log_dir)


def test_a_folder_with_a_broken_image_gives_csv_and_json_with_an_error_row(ckpt, in_tmp):
    write_images(in_tmp / "photos", 3)
    (in_tmp / "photos" / "zz_truncated.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    run = _predict(ckpt, "--data.predict_dir=photos", "--predictions.top_k=2", "--predictions.format=both")
    rows = list(csv.DictReader((run / "predictions.csv").open()))
    # The prefix other tools rely on, then the top-k columns, then the error.
    assert list(rows[0]) == ["path", "prediction", *NAMES, "top1", "top1_prob", "top2", "top2_prob", "error"]
    good, bad = rows[:3], rows[3]
    for row in good:
        assert row["error"] == "" and row["prediction"] == row["top1"]
        assert float(row["top1_prob"]) >= float(row["top2_prob"])
        assert abs(sum(float(row[n]) for n in NAMES) - 1) < 1e-4
    assert bad["path"].endswith("zz_truncated.jpg") and bad["error"] and bad["prediction"] == "" and bad["top1"] == ""
    records = json.loads((run / "predictions.json").read_text())
    assert [r["path"] for r in records] == [r["path"] for r in rows]
    best = records[0]["top_k"][0]
    assert best["class"] == rows[0]["top1"] and best["prob"] == pytest.approx(float(rows[0]["top1_prob"]), abs=1e-6)
    assert records[3]["error"] and records[3]["probs"] == {}
    assert not (in_tmp / "data").exists()  # predict reads the photos it is given: no training set is drawn


def test_a_list_of_files_including_a_missing_one_as_json_only(ckpt, in_tmp):
    a, b = write_images(in_tmp / "some", 2, ext=".png")
    files = f"[{a}, {b}, {in_tmp / 'gone.jpg'}]"
    run = _predict(ckpt, f"--data.predict_files={files}", "--predictions.format=json", "--predictions.top_k=9")
    assert not (run / "predictions.csv").exists()
    records = json.loads((run / "predictions.json").read_text())
    assert [Path(r["path"]).name for r in records] == ["img000.png", "img001.png", "gone.jpg"]
    assert len(records[0]["top_k"]) == 5  # capped at the number of classes
    assert records[2]["prediction"] is None and "gone.jpg" in records[2]["error"]


def test_top_k_below_one_is_refused(ckpt, in_tmp, capsys):
    write_images(in_tmp / "photos", 1)
    args = [f"--ckpt_path={ckpt}", "--data.predict_dir=photos", "--predictions.top_k=0"]
    assert main(["predict", *TINY_RUN, *args]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowers: error: --predictions.top_k must be at least 1 (the most probable classes each row lists), got 0.")
    assert not (in_tmp / "runs").exists()
