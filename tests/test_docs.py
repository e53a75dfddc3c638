"""Every ``flowers`` and ``benchmarks/bench.py`` command that README.md and docs/ show parses: a misspelled or
removed flag fails here."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from flowers.__main__ import SUBCOMMANDS
from flowers.cli import cli_main
from flowers.data.download import parser as download_parser
from flowers.export import parser as export_parser
from flowers.serve import parser as serve_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)(\w*)\n(.*?)^\1", re.DOTALL | re.MULTILINE)
SHELL = ("", "bash", "sh", "console", "shell")
SCRIPTS = ("benchmarks/bench.py", "benchmarks/tutorial_loop.py")
# Placeholders the docs use for numbers a reader fills in (machines M, processes N, rank R).
NUMBERS = {"M": "2", "N": "2", "R": "0", "$((M * N))": "4"}


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(where, words after "flowers")`` for each command in a fenced block; ``\\`` continuations joined."""
    found = []
    for page in PAGES:
        for _, language, block in FENCE.findall(page.read_text()):
            if language not in SHELL:
                continue
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                start = _after_flowers(words)
                if start is not None:
                    found.append((f"{page.name}: {line.strip()}", [NUMBERS.get(w, w) for w in words[start:]]))
    return found


def _after_flowers(words: list[str]) -> int | None:
    for i, word in enumerate(words):
        if word in SCRIPTS and i >= 1 and "python" in words[i - 1]:
            return i  # the bench's words start with its own name, which parse_error dispatches on
        if word in ("flowers", ".venv/bin/flowers") and (i == 0 or "=" in words[i - 1] or words[i - 1] == "time"):
            return i + 1
        if word == "flowers" and i >= 2 and words[i - 1] == "-m" and "python" in words[i - 2]:
            return i + 1
        if word == "flowers" and i >= 1 and words[i - 1] == "-m":  # torchrun … -m flowers
            return i + 1
    return None


def parse_error(words: list[str]) -> str | None:
    """What the CLI says about ``words`` when it refuses them, else None. Nothing runs: only the parser."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if words and words[0] in SCRIPTS:
                _script(words[0]).parse_args([str(ROOT) if w == "$DATA" else w for w in words[1:]])  # a folder
            elif words and words[0] == "export":
                export_parser().parse_args(words[1:])
            elif words and words[0] == "serve":
                serve_parser().parse_args(words[1:])
            elif words and words[0] == "download":
                download_parser().parse_args(words[1:])
            elif words and words[0] == "sweep":
                return _sweep_error(words[1:])
            elif words[:1] in (["--help"], ["-h"]) or (len(words) > 1 and words[1] in ("--help", "-h")):
                return None if not words or words[0] in SUBCOMMANDS or words[0].startswith("-") else "unknown"
            else:
                cli_main([*words, "--print_config"])
        except SystemExit as exit:
            return None if exit.code in (0, None) else err.getvalue() or f"exit {exit.code}"
    return None


def _sweep_error(words: list[str]) -> str | None:
    """What flowers sweep would refuse before its first trial: its options, its file, every fit setting in it."""
    from flowers.errors import ConfigError
    from flowers.sweep import fit_flags, parser
    from flowers.sweep.check import check
    from flowers.sweep.spec import read

    args, rest = parser().parse_known_args(words)
    try:
        check(read(args.config, extra_args=fit_flags(rest)))
    except ConfigError as error:
        return str(error)
    return None


def _script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_show_commands():
    commands = documented_commands()
    assert len(commands) >= 15, commands  # the parser below must find them, or this test checks nothing
    assert {words[0] for _, words in commands} >= {"fit", "validate", "predict", "export", "download",
                                                   "benchmarks/bench.py"}


@pytest.mark.parametrize(("where", "words"), documented_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_documented_command_parses(where, words, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/… paths are relative to the checkout
    assert parse_error(words) is None, where


def test_a_misspelled_flag_is_refused(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert parse_error(["fit", "--config", "configs/tutorial.yaml", "--trainer.max_epochs=3"]) is None
    assert parse_error(["fit", "--config", "configs/tutorial.yaml", "--trainer.max_epoch=3"]) is not None  # a prefix
    assert parse_error(["fit", "--config", "configs/tutorial.yaml", "--trainer.max_epoks=3"]) is not None
    assert parse_error(["export", "--ckpt_path", "x.ckpt", "--formats", "onnx"]) is not None
    assert parse_error(["download", "--folder", "data"]) is not None
    assert parse_error(["sweep", "--config", "configs/sweeps/speedrun.yaml", "--data.data_dirr", "x"]) is not None
    assert parse_error(["benchmarks/bench.py", "--variants", "a,c", "--repeat", "3"]) is not None  # a prefix
    assert parse_error(["export", "--ckpt_path", "x.ckpt", "--form", "onnx"]) is not None
