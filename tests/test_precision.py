"""``precision: auto`` picks bf16 only where it is native, says so, records it, and yields to --trainer.precision."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from flowers import precision
from flowers.cli import cli_main
from tests.helpers.runs import TINY_RUN

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ONE_STEP = ["--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1"]


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """Make this machine's CPU one with the given flags, as /proc/cpuinfo lists them."""

    def with_flags(flags: str) -> None:
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: fpu sse2 avx avx2 fma {flags}\n\n"
                           f"processor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma {flags}\n")
        monkeypatch.setattr(precision, "CPUINFO", cpuinfo)

    return with_flags


@pytest.mark.parametrize(("flags", "expected"), [
    ("", "32-true"), ("avx512f avx512_vnni", "32-true"), ("avx512f avx512_bf16", "bf16-mixed"),
    ("amx_tile amx_bf16 amx_int8", "bf16-mixed"),
])
def test_cpu_flags_decide(fake_cpu, flags, expected):
    fake_cpu(flags)
    assert precision.resolve("cpu")[0] == expected
    assert precision.resolve("auto")[0] == expected or torch.cuda.is_available()


def test_without_a_cpuinfo_bf16_counts_as_emulated(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "CPUINFO", tmp_path / "absent")  # macOS, Windows
    assert precision.resolve("cpu") == ("32-true", "this CPU has no avx512_bf16 or amx_bf16, so bf16 would be "
                                                   "emulated")


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_a_gpu_decides_by_its_own_bf16(fake_cpu, monkeypatch, bf16, expected):
    fake_cpu("avx512_bf16" if not bf16 else "")  # the CPU's flags do not matter on a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert precision.resolve("gpu")[0] == expected
    assert precision.resolve("auto")[0] == expected


@pytest.mark.parametrize(("flags", "expected"), [("", "32-true"), ("avx512_bf16", "bf16-mixed")])
def test_fast_yaml_resolves_auto_logs_it_and_records_it(fake_cpu, flags, expected, in_tmp, tiny_synthetic, caplog):
    fake_cpu(flags)
    with caplog.at_level(logging.INFO):
        cli = cli_main(["fit", "--config", str(CONFIGS / "fast.yaml"), *TINY_RUN, *ONE_STEP,
                        f"--data.data_dir={tiny_synthetic}"])
    assert cli.trainer.precision == expected
    assert f"precision: auto -> --trainer.precision={expected}" in caplog.text
    saved = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())
    assert saved["precision"] == "auto" and saved["trainer"]["precision"] == expected


@pytest.mark.parametrize("explicit", ["bf16-mixed", "32-true"])
def test_an_explicit_trainer_precision_wins(fake_cpu, explicit, in_tmp, tiny_synthetic):
    fake_cpu("avx512_bf16" if explicit == "32-true" else "")
    cli = cli_main(["--config", str(CONFIGS / "fast.yaml"), *TINY_RUN, f"--data.data_dir={tiny_synthetic}",
                    f"--trainer.precision={explicit}"], run=False)
    assert cli.trainer.precision == explicit


def test_best_yaml_uses_auto_and_the_tutorial_stays_fp32(fake_cpu, in_tmp, tiny_synthetic):
    fake_cpu("avx512_bf16")
    for config, expected in (("best.yaml", "bf16-mixed"), ("tutorial.yaml", "32-true")):
        # The precision is settled as the Trainer is built; a fit would only take time (bf16 is emulated on AVX2).
        cli = cli_main(["--config", str(CONFIGS / config), *TINY_RUN, f"--data.data_dir={tiny_synthetic}"],
                       run=False)
        assert cli.trainer.precision == expected, config
