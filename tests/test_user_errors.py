"""Every subcommand refuses bad input alike: exit status 2, one paragraph on stderr that names the flag or file
and what to do, no traceback, no usage dump, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowers.__main__ import main
from tests.conftest import TINY_RUN
from tests.test_ddp import child_env
from tests.trained_run import trained_run

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


@pytest.fixture
def bad_inputs(in_tmp: Path) -> Path:
    os.mkfifo(in_tmp / "pipe")  # reading it would block until a writer comes
    (in_tmp / "afile").write_text("a file where a folder must go")
    for name in ("apt", "ssh", "cron.d"):  # a system folder given as data: folders, and no images in them
        (in_tmp / "etc" / name).mkdir(parents=True)
        (in_tmp / "etc" / name / "sources.list").write_text("not an image")
    (in_tmp / "unknown.yaml").write_text("data:\n  colour: blue\n")
    return in_tmp


@pytest.mark.parametrize("subcommand, args, names, advice", CASES,
                         ids=[f"{case[0]}-{'-'.join(case[1]).lstrip('-')}" for case in CASES])
def test_bad_input_is_one_paragraph_exit_2_and_nothing_written(subcommand, args, names, advice, bad_inputs,
                                                               capfd, tmp_path_factory, tiny_synthetic):
    run = trained_run(tmp_path_factory, tiny_synthetic) if any("CKPT" in a or "RUN" in a for a in args) else None
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


def test_an_export_the_disk_refuses_is_one_paragraph_and_leaves_no_part(tmp_path, tmp_path_factory, tiny_synthetic):
    ckpt = trained_run(tmp_path_factory, tiny_synthetic) / "checkpoints" / "last.ckpt"
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
    from flowers.__main__ import main as flowers

    assert flowers(["fitt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowers: error: 'fitt' is not a subcommand") and all(name in err for name in SUBCOMMANDS)
