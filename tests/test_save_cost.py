"""benchmarks/save_cost.py runs and reports what docs/reliability.md quotes (no timings are checked)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_save_cost_benchmark_reports_size_and_time(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks/save_cost.py"), "--repeats", "1", "--dir",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"last\.ckpt: \d+ MiB; save \d+\.\d+ s .* % of the default interval of 60 s", result.stdout)
    assert not list(tmp_path.iterdir())  # its run folder is gone
