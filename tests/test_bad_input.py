"""Bad and hostile input: every command refuses it alike (exit status 2, one paragraph on stderr that names the flag
or file and what to do, no traceback, no usage dump) and writes nothing, or skips it with one warning where skipping
is documented; a run already in ``runs/flowers/version_0`` is left byte for byte as it was."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowers.__main__ import main
from flowers.cli import cli_main
from flowers.module import FlowerClassifier
from tests.helpers.images import make_tree, write_images
from tests.helpers.processes import child_env
from tests.helpers.runs import TINY_RUN

SHORT = ["--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1"]

# (subcommand, arguments, words naming the flag or file, words saying what to do). CKPT is a real run's last.ckpt,
# RUN its checkpoint folder; pipe is a FIFO, afile a file, etc a folder of folders with no images in them.
CASES = [
    ("fit", ["--trainer.max_epochs=-5"], "--trainer.max_epochs=-5", "use 1 or more"),
    ("fit", ["--trainer.max_epochs=0"], "--trainer.max_epochs=0 trains nothing", "use 1 or more"),
    ("fit", ["--trainer.accumulate_grad_batches=0"], "--trainer.accumulate_grad_batches=0", "use 1 or more"),
    ("fit", ["--trainer.devices=0"], "--trainer.devices=0", "use 1 or more"),
    ("fit", ["--ddp_timeout=-1"], "--ddp_timeout=-1", "above 0"),
    ("fit", ["--data.num_workers=-1"], "data.num_workers=-1", "use 0"),
    ("fit", ["--data.batch_size=-4"], "data.batch_size", "at least 1"),
    ("fit", ["--data.crop_scale=[0.5, 2]"], "data.crop_scale", "0 < first <= second <= 1"),
    ("fit", ["--data.mean=[0.5, 0.5, 0.5]", "--data.std=[0.5, 0, 0.5]"], "data.std", "above 0"),
    ("fit", ["--model.weights=pipe"], "--model.weights 'pipe' is a named pipe", "pass a state_dict file"),
    ("fit", ["--model.weights=missing.pth"], "--model.weights 'missing.pth' does not exist", "pass a state_dict"),
    ("fit", ["--data.data_dir=etc"], "'etc/apt' holds no images", "Add images to it"),
    ("fit", ["--data.data_dir=no/such/folder"], "'no/such/folder' does not exist", "Point --data.data_dir"),
    ("fit", ["--config=unknown.yaml"], "data.colour", "flowers fit --help"),
    ("fit", ["--trainer.max_epochz=1"], "--trainer.max_epochz", "flowers fit --help"),
    ("validate", ["--ckpt_path=CKPT", "--data.data_dir=nowhere"], "'nowhere' does not exist", "Point --data.data_dir"),
    ("validate", ["--ckpt_path=CKPT", "--data.eval_batch_size=0"], "data.eval_batch_size", "at least 1"),
    ("test", ["--ckpt_path=CKPT"], "No test set", "Put a test/<class>/ tree there"),
    ("predict", ["--ckpt_path=CKPT", "--data.predict_dir=nowhere"], "--data.predict_dir 'nowhere' does not exist",
     "pass a folder of images"),
    ("predict", ["--ckpt_path=CKPT", "--data.predict_dir=pipe"], "--data.predict_dir 'pipe' is a named pipe",
     "pass a folder of images"),
    ("export", ["--ckpt_path=CKPT", "--image_size=-5"], "--image_size -5", "use at least"),
    ("export", ["--ckpt_path=CKPT", "--output=afile"], "--output 'afile' is a file", "name a new or empty one"),
    ("export", ["--ckpt_path=CKPT", "--output=RUN"], "holds a run's config or checkpoints", "choose another --output"),
    ("export", ["--ckpt_path=pipe"], "--ckpt_path 'pipe' is a named pipe", "pass a checkpoint written by `fit`"),
    ("export", ["--ckpt_path=CKPT", "--format=bogus"], "--format", "choose from"),
    ("serve", ["--ckpt_path=CKPT", "--port=80"], "--port", "1024"),
    ("download", ["--url=notaurl", "--dir=photos"], "--url 'notaurl'", "use an http://"),
    ("download", ["--sha256=xyz", "--dir=photos"], "--sha256 'xyz'", "pass the archive's checksum"),
    ("download", ["--dir=afile"], "'afile'", "download into another folder"),
]

EVALUATION = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
              "--data.num_workers=0")


def listing(*roots: Path) -> dict[str, int]:
    return {str(p): p.lstat().st_mtime_ns for root in roots for p in [root, *root.rglob("*")]}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def bad_inputs(in_tmp: Path) -> Path:
    os.mkfifo(in_tmp / "pipe")  # reading it would block until a writer comes
    (in_tmp / "afile").write_text("a file where a folder must go")
    for name in ("apt", "ssh", "cron.d"):  # a system folder given as data: folders, and no images in them
        (in_tmp / "etc" / name).mkdir(parents=True)
        (in_tmp / "etc" / name / "sources.list").write_text("not an image")
    (in_tmp / "unknown.yaml").write_text("data:\n  colour: blue\n")
    return in_tmp


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


# -- every command alike ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("subcommand, args, names, advice", CASES,
                         ids=[f"{case[0]}-{'-'.join(case[1]).lstrip('-')}" for case in CASES])
def test_bad_input_is_one_paragraph_exit_2_and_nothing_written(subcommand, args, names, advice, bad_inputs,
                                                               capfd, request, tiny_synthetic):
    run = request.getfixturevalue("trained_run") if any("CKPT" in a or "RUN" in a for a in args) else None
    places = {"CKPT": str(run / "checkpoints" / "last.ckpt"), "RUN": str(run / "checkpoints")} if run else {}
    for placeholder, value in places.items():
        args = [a.replace(placeholder, value) for a in args]
    extra = {"fit": [*TINY_RUN, f"--data.data_dir={tiny_synthetic}"], "validate": [*EVALUATION,
             f"--data.data_dir={tiny_synthetic}"], "test": [*EVALUATION, f"--data.data_dir={tiny_synthetic}"],
             "predict": list(EVALUATION)}.get(subcommand, [])
    before = listing(bad_inputs, *([run] if run else []))
    capfd.readouterr()
    try:
        code = main([subcommand, *extra, *args])
    except SystemExit as exit_:  # argparse's own refusals exit from inside parse_args
        code = exit_.code
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and "usage:" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("flowers") and ": error: " in last and names in last, err[-2000:]  # one paragraph
    assert advice in last, last
    assert listing(bad_inputs, *([run] if run else [])) == before  # no runs/, no lock, no export, no download


def test_an_export_the_disk_refuses_is_one_paragraph_and_leaves_no_part(tmp_path, trained_run):
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    limit = 256 * 1024  # far less than the network's weights: the kernel refuses the write past it (EFBIG)
    done = subprocess.run(
        [sys.executable, "-c", "import resource, signal, sys\n"
         "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
         f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
         "from flowers.__main__ import main\n"
         "sys.exit(main(sys.argv[1:]))",
         "export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "out" / "here")],
        capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowers export: error: could not write the export into") and "--output" in last
    assert not (tmp_path / "out").exists()  # the folders it made and the part it wrote are gone


def test_an_unknown_subcommand_lists_every_subcommand(capsys):
    from flowers.__main__ import SUBCOMMANDS

    assert main(["fitt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowers: error: 'fitt' is not a subcommand") and all(name in err for name in SUBCOMMANDS)


def test_the_real_entry_point_shows_the_error_alone(in_tmp):
    # `python -m flowers` as users run it: the usage (130 lines) is for --help, the error comes alone.
    unknown = subprocess.run([sys.executable, "-m", "flowers", "fit", "--trainer.max_epochz=1"], capture_output=True,
                             text=True, timeout=120)
    assert unknown.returncode == 2 and "max_epochz" in unknown.stderr and "Traceback" not in unknown.stderr
    assert "usage:" not in unknown.stderr and "flowers fit --help" in unknown.stderr
    assert unknown.stderr.strip().splitlines()[-1].startswith("flowers: error: unrecognized arguments")
    assert not list(in_tmp.iterdir())


@pytest.fixture
def typo(request, in_tmp) -> tuple[list[str], str]:
    """The arguments of one typo, and words of the error it must get."""
    if request.param == "weights that fit another network":
        torch.save({"conv.weight": torch.zeros(3, 3)}, in_tmp / "weights.pth")
        return ["--model.weights=weights.pth"], "--model.weights weights.pth does not fit"
    if request.param == "init_from another backbone":
        ckpt = request.getfixturevalue("trained_run") / "checkpoints" / "last.ckpt"  # tutorial_alexnet
        return [f"--model.init_from={ckpt}", "--model.backbone=resnet18"], "holds a tutorial_alexnet network"
    raise ValueError(request.param)


@pytest.mark.parametrize("typo", ["weights that fit another network", "init_from another backbone"], indirect=True)
def test_a_fit_refused_by_its_network_checks_makes_no_run_folder(typo, in_tmp, tiny_synthetic, capsys):
    args, words = typo
    data = [] if any(arg.startswith("--data.data_dir") for arg in args) else [f"--data.data_dir={tiny_synthetic}"]
    assert main(["fit", *TINY_RUN, *data, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("flowers: error: ")
    assert words in err
    assert not (in_tmp / "runs").exists()


# -- data folders and images ------------------------------------------------------------------------------------
def test_class_folder_without_images(previous_run, in_tmp, capsys):
    make_tree(in_tmp / "d", {"a": 3})
    (in_tmp / "d" / "b").mkdir()
    (in_tmp / "d" / "b" / "readme.txt").write_text("no pictures here")
    err = fails(capsys, "--data.data_dir=d")
    assert "d/b" in err and "holds no images" in err


def test_train_and_val_with_different_classes(previous_run, in_tmp, capsys):
    make_tree(in_tmp / "d" / "train", {"a": 2, "b": 2})
    make_tree(in_tmp / "d" / "val", {"a": 2, "c": 2})
    err = fails(capsys, "--data.data_dir=d")
    assert "same class folders" in err and "'c'" in err


def test_unreadable_images_are_skipped_and_training_goes_on(previous_run, in_tmp, caplog):
    make_tree(in_tmp / "d", {"a": 4, "b": 4})
    (in_tmp / "d" / "a" / "zero.jpg").write_bytes(b"")
    (in_tmp / "d" / "b" / "fake.png").write_text("not a png")
    good = write_images(in_tmp / "d" / "b", 1, seed=3)[0]
    (in_tmp / "d" / "b" / "cut.jpg").write_bytes(good.read_bytes()[:200])
    assert main(["fit", *TINY_RUN, "--data.data_dir=d"]) == 0
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1  # one warning for the whole set, not one per file
    assert "Skipping 3 unreadable file(s)" in warned[0] and "zero.jpg" in warned[0] and "cut.jpg" in warned[0]


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


# -- settings ---------------------------------------------------------------------------------------------------
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
    (["--data.val_split=1.5"], "val_split"),
    (["--data.image_size=32"], "image_size"),
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


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_checkpoint_path_that_does_not_exist(previous_run, capsys, tiny_synthetic):
    err = fails(capsys, f"--data.data_dir={tiny_synthetic}", "--ckpt_path=nope.ckpt")
    assert "'nope.ckpt' does not exist" in err


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


# -- run folders ------------------------------------------------------------------------------------------------
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
