"""Every module of flowers imports on its own, first: an import cycle shows only in some orders."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# In a process of its own: importing flowers again registers its strategy and classes again.
CHECK = """
import importlib, pkgutil, sys
import flowers
names = [m.name for m in pkgutil.walk_packages(flowers.__path__, "flowers.") if m.name != "flowers.__main__"]
assert "flowers.checkpointing" in names and "flowers.serve.server" in names, names
for name in names:
    for loaded in [n for n in sys.modules if n.startswith("flowers")]:
        del sys.modules[loaded]
    importlib.import_module(name)
print(len(names), "modules")
"""


def test_each_module_imports_first_in_a_fresh_flowers():
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "modules" in result.stdout


LIGHT = """
import sys
import flowers.__main__, flowers.data.download, flowers.serve, flowers.sweep, flowers.errors
heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "lightning", "torchvision", "litserve"})
print(heavy)
"""


def test_the_commands_that_need_no_model_import_neither_torch_nor_lightning():
    # `flowers --help`, `flowers download`, `flowers serve --help` and `flowers sweep --help` then answer in a
    # fraction of a second.
    result = subprocess.run([sys.executable, "-c", LIGHT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
    for command in (["--help"], ["download", "--help"], ["serve", "--help"], ["sweep", "--help"]):
        shown = subprocess.run([sys.executable, "-m", "flowers", *command], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
        assert shown.returncode == 0 and "usage:" in shown.stdout, (command, shown.stderr[-2000:])
