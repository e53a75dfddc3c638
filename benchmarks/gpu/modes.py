"""check_modes.sh's table: ``python benchmarks/gpu/modes.py OUT_DIR [--json FILE] [--parallel N] [--skipped WHY]...``

Reads what each mode left in OUT_DIR: ``modes.order`` (the modes in the order they were started),
``<mode>.status`` (its exit status), ``<mode>.expect`` ("ok", or "refused WORD": the run must stop with
a ``flowers: error:`` line naming WORD and no Python traceback), ``<mode>.log`` and the Throughput
callback's ``<mode>/throughput.json``. Each row's checkpoint keys are compared with the first row's.
Exits 1 when a mode did not do what was expected of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import report

TRACEBACK = "Traceback (most recent call last)"


def _tail(log: str, lines: int = 25) -> str:
    return "\n".join(log.splitlines()[-lines:])


def row(out: Path, name: str, reference: list[str] | None) -> tuple[dict, bool, list[str] | None]:
    """The mode's table row, whether it did what was expected, and its checkpoint keys."""
    status_file, log_file = out / f"{name}.status", out / f"{name}.log"
    status = int(status_file.read_text().strip()) if status_file.is_file() else None
    expect = (out / f"{name}.expect").read_text().split() if (out / f"{name}.expect").is_file() else ["ok"]
    log = log_file.read_text(errors="replace") if log_file.is_file() else ""
    if status is None:
        return {"mode": name, "result": "did not finish"}, False, None
    if expect[0] == "refused":
        errors = [line for line in log.splitlines() if line.startswith("flowers: error:")]
        if status == 0:
            return {"mode": name, "result": "NOT refused"}, False, None
        if TRACEBACK in log or not errors or not all(w.lower() in errors[-1].lower() for w in expect[1:]):
            return {"mode": name, "result": f"refused badly (exit {status}, see {name}.log)"}, False, None
        message = errors[-1][len("flowers: error:"):].strip()
        return {"mode": name, "result": f"refused as expected: {message[:80]}"}, True, None
    record_file = out / name / "throughput.json"
    if status != 0 or not record_file.is_file():
        return {"mode": name, "result": f"FAILED (exit {status})"}, False, None
    r = json.loads(record_file.read_text())
    keys = r["checkpoint_keys"]
    same = "same as 1st run" if reference is None or keys == reference else "DIFFERENT"
    prefixed = any(k.startswith("module.") or ".module." in k for k in keys)
    return {
        "mode": name, "result": "ok" if same != "DIFFERENT" and not prefixed else "FAILED (checkpoint keys)",
        "strategy": r["strategy"], "procs_x_dev": f"{r['world_size']}x{r['devices']}", "precision": r["precision"],
        "compute_dtype": ",".join(d.replace("torch.", "") for d in r["replica_dtypes"]),
        "images_per_s": f"{r['images_per_s']:.0f}" if r["images_per_s"] else "?",
        "val_acc": f"{r['val_acc']:.3f}",
        "checkpoint": f"{len(keys)} keys, {same}" + (", module. prefix!" if prefixed else ""),
    }, same != "DIFFERENT" and not prefixed, keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu/modes.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--skipped", action="append", default=[], help="a mode left out and why (repeatable)")
    args = parser.parse_args(argv)
    order_file = args.out_dir / "modes.order"
    names = order_file.read_text().split() if order_file.is_file() else []
    rows, failed, reference = [], [], None
    for name in names:
        entry, ok, keys = row(args.out_dir, name, reference)
        reference = reference if reference is not None else keys  # the first run that saved a checkpoint
        rows.append(entry)
        if not ok:
            failed.append(name)
            log = args.out_dir / f"{name}.log"
            if log.is_file():
                print(f"--- {name}: the end of {log}\n{_tail(log.read_text(errors='replace'))}")
    result = {"rows": rows, "parallel": args.parallel, "skipped": args.skipped, "failed": failed}
    print(report.heading("modes"))
    print(report.modes_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if failed:
        print(f"failed modes: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed or not names else 0


if __name__ == "__main__":
    sys.exit(main())
