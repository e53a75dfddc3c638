"""Fixtures: tiny data sets, trained runs and servers, each made once and shared where only *a* run is needed.

The builders behind them are in tests/helpers/; a test imports those from there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.images import REAL_PHOTOS
from tests.helpers.runs import TINY_RUN, fit_in

# The suite writes about 9 GB of checkpoints, fsynced: a RAM folder saves a fifth (docs/benchmarks.md).
RAM_FOLDER = Path("/dev/shm")
RAM_NEEDED = 8 << 30  # twice the most a run was seen to hold at once (the shared trained runs, the tests in flight)
RAM_BASETEMP = pytest.StashKey[str]()
KEPT = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Keep torch from oversubscribing the cores: one thread per xdist worker (and per process it starts), else 2.
    several_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
    os.environ.setdefault("OMP_NUM_THREADS", "1" if several_workers else "2")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if config.option.basetemp is None and not hasattr(config, "workerinput") and _has_room(RAM_FOLDER):
        # xdist's workers get folders inside it; --basetemp chooses another place.
        config.option.basetemp = config.stash[RAM_BASETEMP] = tempfile.mkdtemp(prefix="flowers-tests-", dir=RAM_FOLDER)


def _has_room(folder: Path) -> bool:
    try:
        return os.access(folder, os.W_OK) and shutil.disk_usage(folder).free >= RAM_NEEDED
    except OSError:
        return False


def pytest_sessionfinish(session, exitstatus):
    ram = session.config.stash.get(RAM_BASETEMP, None)
    if ram is None:
        return
    if exitstatus == 0:
        shutil.rmtree(ram, ignore_errors=True)
    else:  # the failed tests' folders, to read afterwards, without holding the memory
        kept = Path(tempfile.gettempdir()) / Path(ram).name
        shutil.move(ram, kept)
        session.config.stash[KEPT] = kept


def pytest_terminal_summary(terminalreporter, config):
    kept = config.stash.get(KEPT, None)
    if kept is not None:
        terminalreporter.write_line(f"the failed tests' folders are in {kept}")


@pytest.fixture(scope="session")
def tiny_synthetic(tmp_path_factory) -> Path:
    """A small synthetic flower set in the single-folder layout, drawn once per test run."""
    from flowers.data import synthetic

    return synthetic.ensure_synthetic(tmp_path_factory.mktemp("synthetic") / "flowers", per_class=12, size=72)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in a fresh folder so runs/ and data/ land in tmp, not in the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def real_photos() -> Path:
    if not REAL_PHOTOS.is_dir():
        pytest.skip(f"real photos not found at {REAL_PHOTOS} (set FLOWERS_DATA_DIR)")
    return REAL_PHOTOS


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_synthetic) -> Path:
    """The absolute ``runs/flowers/version_0`` of a 2-epoch tiny fit: for tests that only read *a* run's files."""
    root = tmp_path_factory.mktemp("trained")
    cli = fit_in(root, *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--trainer.max_epochs=2")
    return (root / cli.trainer.log_dir).resolve()


@pytest.fixture(scope="session")
def backbone_run(tmp_path_factory, tiny_synthetic):
    """``backbone_run(name)``: the run folder of a tiny fit of that backbone, trained once per test run."""
    runs: dict[str, Path] = {}

    def run(backbone: str) -> Path:
        if backbone not in runs:
            root = tmp_path_factory.mktemp(backbone)
            cli = fit_in(root, *TINY_RUN, "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2",
                         "--seed_everything=3", f"--data.data_dir={tiny_synthetic}", f"--model.backbone={backbone}")
            runs[backbone] = (root / cli.trainer.log_dir).resolve()
        return runs[backbone]

    return run


@pytest.fixture(scope="session")
def mirror_run(tmp_path_factory, trained_run) -> Path:
    """The shared run with mirror-image evaluation on; its checkpoint is ``checkpoints/best.ckpt``."""
    from tests.helpers.serving import mirror_copy

    return mirror_copy(trained_run, tmp_path_factory.mktemp("mirror") / "version_0")


@pytest.fixture(scope="session")
def served(request, tmp_path_factory, mirror_run):
    """A server of the mirror-image checkpoint with a 100 ms window (concurrent requests surely share batches) and
    small limits."""
    pytest.importorskip("litserve", reason="flowers serve runs on LitServe (pip install -e '.[serve]')")
    from tests.helpers.serving import BODY_TIMEOUT_S, DECODE_BUDGET_MB, MAX_UPLOADS, TOP_K, Server

    ckpt = mirror_run / "checkpoints" / "best.ckpt"
    server = Server(["--ckpt_path", str(ckpt), "--batch_window_ms", "100", "--max_batch_size", "8",
                     "--top_k", str(TOP_K), "--body_timeout_s", str(BODY_TIMEOUT_S), "--max_uploads", str(MAX_UPLOADS),
                     "--decode_budget_mb", str(DECODE_BUDGET_MB)], tmp_path_factory.mktemp("serve") / "checkpoint.log")
    request.addfinalizer(server.stop)
    return server.wait_ready()


@pytest.fixture(scope="session")
def onnx_served(request, tmp_path_factory, mirror_run):
    """A server of the same checkpoint's ONNX export."""
    pytest.importorskip("litserve", reason="flowers serve runs on LitServe (pip install -e '.[serve]')")
    from flowers.export import export
    from tests.helpers.serving import Server

    folder = export(mirror_run / "checkpoints" / "best.ckpt", "onnx").parent  # serve finds the file by its suffix
    server = Server(["--ckpt_path", str(folder)], tmp_path_factory.mktemp("serve") / "onnx.log")
    request.addfinalizer(server.stop)
    return server.wait_ready()
