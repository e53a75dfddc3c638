"""``python benchmarks/setup_scale.py --sizes 10000,30000,100000``: how data setup grows with the folder.

docs/benchmarks.md ("Data setup at scale") describes the method and gives the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("list", "check", "split", "cache")
IMAGE_SIZE = 64  # the data.image_size the cache is built for


def measure(folder: Path) -> dict:
    """One setup of ``folder`` in this process (run as a child: its peak memory is the setup's)."""
    from flowers.data import folders
    from flowers.data.cache import CACHE_FOLDER, cache_side, ensure_cache, fitting_side

    checked = []
    real_check = folders.image_problem
    folders.image_problem = lambda path: (checked.append(1), real_check(path))[1]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    marks = [time.perf_counter()]  # each phase's end
    samples = folders.list_images(folder, folders.find_classes(folder))
    marks.append(time.perf_counter())
    samples = folders.drop_unreadable(samples, where=folder, record=folder / CACHE_FOLDER / "verified-bench.json")
    marks.append(time.perf_counter())
    train, val = folders.stratified_split(samples, val_fraction=0.1, seed=42)
    marks.append(time.perf_counter())
    paths = [s.path for s in train + val]
    cache = ensure_cache(paths, root=folder, side=fitting_side(paths, cache_side(IMAGE_SIZE)),
                         fallback_dir=folder.parent / "cache")
    marks.append(time.perf_counter())
    times = {phase: end - begin for phase, begin, end in zip(PHASES, marks, marks[1:], strict=False)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"images": len(samples), "seconds": times, "decoded_in_check": len(checked),
            "cache_mib": cache.pixels.nbytes / 2**20, "peak_rss_mib": peak / 1024,
            "rss_after_imports_mib": baseline / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,30000,100000", help="comma-separated image counts")
    parser.add_argument("--work", type=Path, default=Path("data/setup_scale"), help="where the folders are drawn")
    parser.add_argument("--photo-size", type=int, default=48, help="side of the synthetic photos")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure)))
        return

    from flowers.data import synthetic

    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        folder = args.work / f"flowers-{size}"
        start = time.perf_counter()
        synthetic.ensure_synthetic(folder, per_class=size // len(synthetic.CLASS_NAMES), size=args.photo_size)
        drawn = time.perf_counter() - start
        for run in ("first", "again"):
            child = subprocess.run([sys.executable, __file__, "--measure", str(folder)], capture_output=True,
                                   text=True, check=True)
            rows.append({"size": size, "run": run, "drawn_s": drawn, **json.loads(child.stdout.splitlines()[-1])})
    print(f"{'images':>8} {'run':>6} " + " ".join(f"{p + ' s':>8}" for p in PHASES)
          + f" {'total s':>8} {'µs/image':>9} {'decoded':>8} {'cache MiB':>10} {'+peak MiB':>10}")
    for row in rows:
        total = sum(row["seconds"].values())
        print(f"{row['images']:>8} {row['run']:>6} " + " ".join(f"{row['seconds'][p]:>8.2f}" for p in PHASES)
              + f" {total:>8.2f} {1e6 * total / row['images']:>9.0f} {row['decoded_in_check']:>8}"
              f" {row['cache_mib']:>10.0f} {row['peak_rss_mib'] - row['rss_after_imports_mib']:>10.0f}")
    print(f"synthetic photos of {args.photo_size} px; cache for data.image_size={IMAGE_SIZE}; "
          "+peak = how far setup raised the process's peak resident memory above its imports' "
          f"({rows[0]['rss_after_imports_mib']:.0f} MiB)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
