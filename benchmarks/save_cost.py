"""``python benchmarks/save_cost.py``: what a mid-epoch ``last.ckpt`` costs, in bytes and seconds.

The size depends on the recipe, not on the data: synthetic flowers will do. docs/reliability.md gives the figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from flowers.cli import cli_main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the run folder goes (its disk is timed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        cli = cli_main(["fit", "--config", "configs/tutorial.yaml", "--data.data_dir=null",
                        f"--data.synthetic_dir={folder}/synthetic", "--data.synthetic_per_class=8",
                        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0",
                        "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu",
                        f"--trainer.logger.init_args.save_dir={folder}/runs", f"--checkpoint.dirpath={folder}/ckpt"])
        target = Path(folder) / "ckpt" / "last.ckpt"
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            cli.trainer.save_checkpoint(target)
            times.append(time.perf_counter() - start)
        size = target.stat().st_size
    median = statistics.median(times)
    interval = cli.config["fit"]["checkpoint"]["train_time_interval"].total_seconds()  # the default, unchanged above
    print(f"last.ckpt: {size / 2**20:.0f} MiB; save {median:.2f} s (min {min(times):.2f}, max {max(times):.2f}, "
          f"{args.repeats} saves) = {100 * median / interval:.1f} % of the default interval of {interval:.0f} s")


if __name__ == "__main__":
    main()
