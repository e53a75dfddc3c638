"""Hostile or broken input: each case ends in one clear error (exit 2, no traceback) or a documented skip,
and the run already in ``runs/flowers/version_0`` is left byte for byte as it was."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowers.cli import cli_main, main
from flowers.module import FlowerClassifier
from tests.conftest import TINY_RUN, make_tree

SHORT = ["--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def previous_run(in_tmp) -> Path:
    """A finished run's files, as a new command must find them again afterwards."""
    run = in_tmp / "runs" / "flowers" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed_everything: 42\n")
    (run / "hparams.yaml").write_text("num_classes: 5\n")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"the previous run's weights")
    (run / "checkpoints" / "best-epoch=03-val_acc=0.9000.ckpt").write_bytes(b"its best weights")
    before = snapshot(run)
    yield run
    assert snapshot(run) == before, "the previous run's files changed"


def fails(capsys, *args: str, subcommand: str = "fit") -> str:
    code = main([subcommand, *TINY_RUN, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("flowers: error: ")
    return err


def flowers_checkpoint(path: Path, classes: list[str], *, hparams: bool = True) -> Path:
    model = FlowerClassifier(num_classes=len(classes), class_names=classes)
    checkpoint = {"state_dict": model.state_dict(), "epoch": 0, "global_step": 1}
    if hparams:
        checkpoint["hyper_parameters"] = dict(model.hparams)
    torch.save(checkpoint, path)
    return path


# -- images and folders ------------------------------------------------------------------------------
def bomb_png(path: Path, width: int, height: int) -> Path:
    """A valid 1-bit PNG of ``width x height`` black pixels: a few hundred kB that decode to far more."""
    row = b"\x00" + bytes((width + 7) // 8)
    pixels = zlib.compress(row * height, 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("pixels", [100_000_000, 200_000_000], ids=["warning-level", "error-level"])
def test_decompression_bomb_is_skipped_with_the_one_warning(pixels, previous_run, in_tmp, capsys, caplog):
    make_tree(in_tmp / "d", {"a": 3, "b": 3}, size=64)
    bomb = bomb_png(in_tmp / "d" / "a" / "bomb.png", 20_000, pixels // 20_000)
    assert bomb.stat().st_size < 2_000_000 and pixels > Image.MAX_IMAGE_PIXELS
    assert main(["fit", *TINY_RUN, "--data.data_dir=d", *SHORT]) == 0
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1 and "bomb.png" in warned[0] and "decompression bomb" in warned[0].lower()


def test_decompression_bomb_without_verification_is_a_clear_error(previous_run, in_tmp, capsys):
    make_tree(in_tmp / "d", {"a": 3, "b": 3}, size=64)
    bomb_png(in_tmp / "d" / "a" / "bomb.png", 20_000, 10_000)
    # With verify_images off the bomb reaches the loader; it must name the file, not decode 200 M pixels.
    err = fails(capsys, "--data.data_dir=d", "--data.verify_images=false", "--data.batch_size=8",
                "--trainer.limit_train_batches=1", "--trainer.num_sanity_val_steps=0")
    assert "bomb.png" in err and "verify_images" in err


def test_symlink_loops_inside_a_class_folder_are_not_followed(previous_run, in_tmp, caplog):
    make_tree(in_tmp / "d", {"a": 3, "b": 3}, size=64)
    (in_tmp / "d" / "a" / "again").symlink_to(in_tmp / "d")  # a folder loop: the walk must not enter it
    (in_tmp / "d" / "b" / "self.jpg").symlink_to(in_tmp / "d" / "b" / "self.jpg")  # ELOOP on open
    cli = cli_main(["fit", *TINY_RUN, "--data.data_dir=d", *SHORT])
    assert cli.datamodule.class_names == ["a", "b"]
    assert len(cli.datamodule.train_set) + len(cli.datamodule.val_set) == 6
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1 and "self.jpg" in warned[0]


@pytest.mark.parametrize("link", ["itself", "the data folder"])
def test_a_class_folder_that_is_a_symlink_loop_is_a_clear_error(link, previous_run, in_tmp, capsys):
    make_tree(in_tmp / "d", {"a": 3, "b": 3}, size=64)
    loop = in_tmp / "d" / "c"
    loop.symlink_to(loop if link == "itself" else in_tmp / "d")
    err = fails(capsys, "--data.data_dir=d")
    assert "d/c" in err and "symlink loop" in err


def test_unreadable_files_are_skipped_fifo_dangling_link_and_no_permission(previous_run, in_tmp, caplog):
    make_tree(in_tmp / "d", {"a": 3, "b": 3}, size=64)
    os.mkfifo(in_tmp / "d" / "a" / "pipe.jpg")  # opening it would block forever
    (in_tmp / "d" / "b" / "gone.jpg").symlink_to(in_tmp / "nowhere.jpg")
    locked = make_tree(in_tmp / "d", {"b": 1}, size=64, seed=9) and in_tmp / "d" / "b" / "img000.jpg"
    locked.chmod(0)  # unreadable for anyone but root (root reads it anyway, and then it is a good image)
    cli_main(["fit", *TINY_RUN, "--data.data_dir=d", *SHORT])
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1 and "pipe.jpg" in warned[0] and "gone.jpg" in warned[0]
    assert ("img000.jpg" in warned[0]) == (os.geteuid() != 0)


def test_data_dir_that_is_a_file(previous_run, in_tmp, capsys):
    (in_tmp / "photos.tgz").write_bytes(b"\x1f\x8b not really")
    err = fails(capsys, "--data.data_dir=photos.tgz")
    assert "'photos.tgz' is a file, not a folder" in err


# -- settings ---------------------------------------------------------------------------------------
def test_yaml_with_a_wrong_type_names_the_key(previous_run, in_tmp, capsys, tiny_synthetic):
    (in_tmp / "bad.yaml").write_text("data:\n  batch_size: four\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config=bad.yaml", f"--data.data_dir={tiny_synthetic}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "batch_size" in err and "four" in err and "Traceback" not in err
    # The error alone: the usage (130 lines) is for --help.
    assert "usage:" not in err and err.strip().splitlines() == [err.strip()] and err.startswith("flowers: error: ")


@pytest.mark.parametrize("args, message", [
    (["--trainer.accelerator=gpu", "--trainer.devices=64"], "--trainer.devices=64 asks for 64 GPU(s)"),
    (["--data.batch_size=0"], "batch_size"),
    (["--data.val_split=0"], "val_split"),
    (["--data.val_split=1"], "val_split"),
    (["--data.val_split=-0.5"], "val_split"),
])
def test_out_of_range_settings_leave_the_previous_run_alone(args, message, previous_run, capsys, tiny_synthetic):
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", *args)
    assert message in err


def test_an_output_folder_in_the_way_or_read_only(previous_run, in_tmp, capsys, tiny_synthetic):
    (in_tmp / "blocked").write_text("a file where the run folder should go")
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--trainer.logger.init_args.save_dir=blocked")
    assert "'blocked/flowers' cannot be written" in err
    read_only = in_tmp / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:
        read_only = Path("/sys/flowers-test-runs")  # root writes through 0o555; /sys is read-only for all
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", f"--trainer.logger.init_args.save_dir={read_only}")
    assert "cannot be written" in err and str(read_only) in err


# -- checkpoints ------------------------------------------------------------------------------------
def test_checkpoint_of_another_model(previous_run, in_tmp, capsys, tiny_synthetic):
    torch.save({"state_dict": {"fc.weight": torch.zeros(10, 3)}, "hyper_parameters": {}}, in_tmp / "resnet.ckpt")
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=resnet.ckpt")
    assert "not a flowers checkpoint" in err and "size mismatch" not in err


@pytest.mark.parametrize("hparams", [True, False], ids=["with-class-names", "weights-only"])
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_checkpoint_with_another_number_of_classes(hparams, subcommand, previous_run, in_tmp, capsys,
                                                   tiny_synthetic):
    flowers_checkpoint(in_tmp / "three.ckpt", ["cat", "dog", "owl"], hparams=hparams)
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=three.ckpt", subcommand=subcommand)
    assert "size mismatch" not in err
    if hparams:  # the class names travel in the checkpoint: the data check names both lists
        assert "trained on classes ['cat', 'dog', 'owl']" in err and "'daisy'" in err
    else:  # bare weights: the classifier's rows give the count
        assert "'three.ckpt' was trained for 3 classes, but the data has 5" in err


def test_truncated_real_checkpoint(previous_run, in_tmp, capsys, tiny_synthetic):
    whole = flowers_checkpoint(in_tmp / "whole.ckpt", ["a", "b"]).read_bytes()
    (in_tmp / "cut.ckpt").write_bytes(whole[: len(whole) // 2])
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=cut.ckpt")
    assert "'cut.ckpt' cannot be read as a" in err


def test_resume_last_without_any_run(in_tmp, capsys, tiny_synthetic):
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=last")
    assert "--ckpt_path last: no runs/flowers/version_*/checkpoints/" in err


# -- run folders ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["--trainer.logger.init_args.version=0",
                                 "--checkpoint.dirpath=runs/flowers/version_0/checkpoints"])
def test_a_new_run_never_writes_into_a_folder_that_holds_a_run(arg, previous_run, capsys, tiny_synthetic):
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", arg, *SHORT)
    assert "already holds a run" in err and "--ckpt_path last" in err


def test_a_new_run_goes_to_the_next_version(previous_run, in_tmp, tiny_synthetic):
    cli = cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *SHORT])
    assert cli.trainer.log_dir == os.path.join("runs", "flowers", "version_1")
    assert (in_tmp / cli.trainer.log_dir / "config.yaml").is_file()


def test_validate_without_a_logger_twice_keeps_both_configs(in_tmp, tiny_synthetic):
    # With --trainer.logger=false every validate shares the working folder; none may refuse or overwrite.
    run = [*TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.limit_val_batches=1"]
    cli_main(["fit", *run, "--trainer.limit_train_batches=1"])
    for _ in range(3):
        cli_main(["validate", *run, "--trainer.logger=false", "--ckpt_path=last"])
    assert sorted(p.name for p in in_tmp.glob("config*.yaml")) == [
        "config-validate-1.yaml", "config-validate-2.yaml", "config.yaml"]


def test_threads_opening_images_at_once_all_refuse_the_bomb(tmp_path):
    # The image check runs in threads: each must refuse a warning-level bomb, whatever the others are doing.
    from concurrent.futures import ThreadPoolExecutor

    from flowers.data.images import open_image

    bomb = str(bomb_png(tmp_path / "bomb.png", 20_000, 5_000))
    (plain,) = make_tree(tmp_path / "ok", {"a": 1}, size=16).glob("a/*")

    def refused(path: str) -> bool:
        try:
            with open_image(path):
                return False
        except Image.DecompressionBombError:
            return True

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(refused, [bomb, str(plain)] * 200))
    assert results == [True, False] * 200
