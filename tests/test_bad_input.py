"""Bad input ends with a short, specific error and a non-zero exit, never a traceback wall."""

import subprocess
import sys

import pytest

from flowers.cli import main
from tests.conftest import TINY_RUN, make_tree, write_images


def run_main(capsys, *args):
    code = main(["fit", *TINY_RUN, *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_missing_data_dir(in_tmp, capsys):
    code, err = run_main(capsys, "--data.data_dir=no/such/folder")
    assert code == 2 and "'no/such/folder' does not exist" in err


def test_class_folder_without_images(in_tmp, capsys):
    make_tree(in_tmp / "d", {"a": 3})
    (in_tmp / "d" / "b").mkdir()
    (in_tmp / "d" / "b" / "readme.txt").write_text("no pictures here")
    code, err = run_main(capsys, "--data.data_dir=d")
    assert code == 2 and "d/b" in err and "holds no images" in err


def test_train_and_val_with_different_classes(in_tmp, capsys):
    make_tree(in_tmp / "d" / "train", {"a": 2, "b": 2})
    make_tree(in_tmp / "d" / "val", {"a": 2, "c": 2})
    code, err = run_main(capsys, "--data.data_dir=d")
    assert code == 2 and "same class folders" in err and "'c'" in err


def test_checkpoint_path_that_does_not_exist(in_tmp, capsys, tiny_synthetic):
    code, err = run_main(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=nope.ckpt")
    assert code == 2 and "'nope.ckpt' does not exist" in err


def test_truncated_checkpoint(in_tmp, capsys, tiny_synthetic):
    (in_tmp / "bad.ckpt").write_bytes(b"PK\x03\x04 truncated")
    code, err = run_main(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=bad.ckpt")
    assert code == 2 and "'bad.ckpt' cannot be read as a" in err


@pytest.mark.parametrize("arg, message", [
    ("--data.val_split=1.5", "val_split"),
    ("--data.batch_size=0", "batch_size"),
    ("--data.image_size=32", "image_size"),
])
def test_out_of_range_settings(in_tmp, capsys, tiny_synthetic, arg, message):
    code, err = run_main(capsys, f"--data.data_dir={tiny_synthetic}", arg)
    assert code == 2 and message in err


def test_unreadable_images_are_skipped_and_training_goes_on(in_tmp, capsys, caplog):
    make_tree(in_tmp / "d", {"a": 4, "b": 4})
    (in_tmp / "d" / "a" / "zero.jpg").write_bytes(b"")
    (in_tmp / "d" / "b" / "fake.png").write_text("not a png")
    good = write_images(in_tmp / "d" / "b", 1, seed=3)[0]
    (in_tmp / "d" / "b" / "cut.jpg").write_bytes(good.read_bytes()[:200])
    code, _ = run_main(capsys, "--data.data_dir=d")
    assert code == 0
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1  # one warning for the whole set, not one per file
    assert "Skipping 3 unreadable file(s)" in warned[0] and "zero.jpg" in warned[0] and "cut.jpg" in warned[0]


def test_real_entry_point_unknown_key_and_missing_dir(in_tmp):
    def flowers(*args):
        return subprocess.run([sys.executable, "-m", "flowers", "fit", *args], capture_output=True, text=True,
                              timeout=120)

    unknown = flowers("--trainer.max_epochz=1")
    assert unknown.returncode == 2 and "max_epochz" in unknown.stderr and "Traceback" not in unknown.stderr
    # The error alone, not after 130 lines of usage: the usage is for --help.
    assert "usage:" not in unknown.stderr and "flowers fit --help" in unknown.stderr
    assert unknown.stderr.strip().splitlines()[-1].startswith("flowers: error: unrecognized arguments")
    missing = flowers("--data.data_dir=nowhere")
    assert missing.returncode == 2 and "'nowhere' does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) <= 3
