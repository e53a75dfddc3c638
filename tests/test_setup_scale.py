"""Data setup on a folder of 20,000 images, through benchmarks/setup_scale.py (no timings are checked)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_twenty_thousand_images_are_set_up_and_a_second_run_decodes_none(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/setup_scale.py"), "--sizes", "20000",
                           "--photo-size", "32", "--work", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    first, again = json.loads(out.read_text())
    assert first["images"] == again["images"] == 20000
    assert first["decoded_in_check"] == 20000 and again["decoded_in_check"] == 0  # the record of checked files
    assert first["cache_mib"] == pytest.approx(20000 * 3 * 32 * 32 / 2**20)  # photos are not upsampled
    # The build writes through a memory map: the process never holds the whole cache.
    assert first["peak_rss_mib"] - first["rss_after_imports_mib"] < first["cache_mib"]
