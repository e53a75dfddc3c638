"""``python benchmarks/serve_load.py``: latency and throughput of ``flowers serve`` under concurrent clients.

``--decode`` instead times the decode of the largest uploads. docs/benchmarks.md and docs/serving.md give the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from flowers.data.synthetic import draw_flower
from flowers.serve.uploads import open_upload, return_large_frees, square_of

WARMUP, TIMEOUT_S, SIDE = 16, 30.0, 224  # unmeasured requests per run; seconds a request may take; --decode's side


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/serve_load.py", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--ckpt_path", help="serve this checkpoint or export, once per window")
    target.add_argument("--url", help="measure a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--decode", action="store_true", help="measure the decode of the largest uploads (no server)")
    target.add_argument("--decode-one", metavar="IMAGE", help=argparse.SUPPRESS)
    p.add_argument("--windows", default="0,5", help="batch windows in ms, comma-separated (with --ckpt_path)")
    p.add_argument("--max-batch-size", type=int, default=16, help="the servers' --max_batch_size")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, one connection each")
    p.add_argument("--requests", type=int, default=400, help="measured requests per run, over all clients")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def photos() -> list[bytes]:
    rng, buffers = np.random.default_rng(0), [io.BytesIO() for _ in range(8)]
    for i, buffer in enumerate(buffers):
        draw_flower(i % 5, rng, size=240).save(buffer, "JPEG", quality=90)
    return [buffer.getvalue() for buffer in buffers]


def cpu() -> str:
    """The CPU's model, its extensions that decide inference speed, and its cores."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v for k, v in (line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in fields.get("flags", "").split()]
    return f"{fields.get('model name', ' unknown').strip()} ({', '.join(flags) or 'no avx2'}), {os.cpu_count()} cores"


def connect(url: str, timeout: float = TIMEOUT_S) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=timeout)


def get(url: str, path: str) -> tuple[int, bytes]:
    with contextlib.closing(connect(url, timeout=10)) as connection:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()


class Server:
    """``python -m flowers serve`` on a free port of 127.0.0.1, in its own process group."""

    def __init__(self, ckpt_path: str, window_ms: float, max_batch_size: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "flowers", "serve", "--ckpt_path", ckpt_path, "--port", str(port),
                   "--batch_window_ms", str(window_ms), "--max_batch_size", str(max_batch_size)]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.failed(f"exited with {self.process.returncode}")
            with contextlib.suppress(OSError):
                if get(self.url, "/health")[0] == 200:
                    return self.url
            time.sleep(0.2)
        raise self.failed(f"was not ready within {timeout} s")

    def failed(self, why: str) -> SystemExit:
        # The output itself: stop() removes the log file on the way out.
        return SystemExit(f"flowers serve {why}; its output ends:\n{Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the server's own workers too
        self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


def load(url: str, images: list[bytes], requests: int, clients: int) -> dict:
    """``requests`` POSTs from ``clients`` threads, each on its own keep-alive connection."""
    latencies, errors, sizes = [], [], []  # list.append is atomic: the threads share them
    start = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        connection = connect(url)
        start.wait()
        for n in range(index, requests, clients):  # the run's requests n, every clients-th from its own index
            sent = time.perf_counter()
            try:
                connection.request("POST", "/predict", images[n % len(images)], {"Content-Type": "image/jpeg"})
                response = connection.getresponse()
                answer = response.read()
            except OSError as failure:
                errors.append(f"{type(failure).__name__}: {failure}")
                connection.close()  # the next request opens it again
                continue
            latencies.append(time.perf_counter() - sent)
            if response.status != 200:
                errors.append(f"HTTP {response.status}: {answer[:200]!r}")
            sizes.append(int(response.getheader("X-Batch-Size", "0")))
        connection.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    p50, p99 = (1000 * float(np.quantile(latencies, q)) if latencies else float("nan") for q in (0.5, 0.99))
    return {"clients": clients, "requests": requests, "errors": len(errors), "first_errors": errors[:3],
            "p50_ms": p50, "p99_ms": p99, "requests_per_s": requests / wall, "wall_s": wall,
            "batch_sizes": {str(k): v for k, v in sorted(Counter(sizes).items())}}


def spread(values: list[float], digits: int = 1) -> str:
    median = f"{np.median(values):.{digits}f}"
    return median if len(values) == 1 else f"{median} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(runs: list[dict]) -> str:
    lines = ["| batch window | clients | requests | p50 latency (ms) | p99 latency (ms) | requests/s | errors "
             "| answers by batch size |", "|---|---|---|---|---|---|---|---|"]
    for window in dict.fromkeys(run["window_ms"] for run in runs):
        mine = [run for run in runs if run["window_ms"] == window]
        sizes = sum((Counter({int(k): v for k, v in run["batch_sizes"].items()}) for run in mine), Counter())
        total = sum(sizes.values()) or 1
        shares = ", ".join(f"{size}: {100 * count / total:.0f} %" for size, count in sorted(sizes.items()))
        lines.append(f"| {window:g} ms | {mine[0]['clients']} | {mine[0]['requests']} × {len(mine)} "
                     f"| {spread([r['p50_ms'] for r in mine])} | {spread([r['p99_ms'] for r in mine])} "
                     f"| {spread([r['requests_per_s'] for r in mine], 0)} | {sum(r['errors'] for r in mine)} "
                     f"| {shares} |")
    return "\n".join(lines)


def largest_uploads(folder: Path) -> dict[str, Path]:
    """The images --decode measures, written into ``folder``: the largest of each kind under PIL's pixel limit."""
    def png(side: int, depth: int, color: int, row: bytes) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        packer = zlib.compressobj(6)
        data = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
        header = struct.pack(">IIBBBBB", side, side, depth, color, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")

    def ramp(side: int, channels: int) -> bytes:  # one filter byte, then the row's pixels
        return b"\x00" + np.repeat(np.arange(side) % 256, channels).astype(np.uint8).tobytes()

    gray16 = b"\x00" + (np.arange(9400) * 7).astype(">u2").tobytes()
    files = {"16-bit grayscale PNG, 9,400 x 9,400": png(9400, 16, 0, gray16),
             "1-bit PNG, 9,400 x 9,400": png(9400, 1, 0, b"\x00" + b"\xaa" * 1175),
             "RGB PNG, 9,400 x 9,400": png(9400, 8, 2, ramp(9400, 3)),
             "RGBA PNG, 7,400 x 7,400": png(7400, 8, 6, ramp(7400, 4)),
             "RGBA PNG, 9,400 x 9,400": png(9400, 8, 6, ramp(9400, 4))}
    paths = {}
    for name, data in files.items():
        paths[name] = folder / f"{len(paths)}.png"
        paths[name].write_bytes(data)
    small = np.random.default_rng(5).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    photo = Image.fromarray(small).resize((8000, 6000), Image.Resampling.BICUBIC)
    for name, options in (("JPEG, 8,000 x 6,000 (48 MP)", {}),
                          ("progressive JPEG, 8,000 x 6,000, 4:2:0", {"progressive": True}),
                          ("progressive JPEG, 8,000 x 6,000, 4:4:4", {"progressive": True, "subsampling": 0})):
        paths[name] = folder / f"{len(paths)}.jpg"
        photo.save(paths[name], quality=92, **options)
    return paths


def decode_one(path: str) -> dict:
    """In this fresh process: decode ``path`` as the HTTP process does, in a thread, and measure it."""
    def status(field: str) -> float:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    return_large_frees()  # as the server's HTTP process does
    data = Path(path).read_bytes()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from here
    result: dict = {"bytes": len(data)}

    def run() -> None:
        image, cost = open_upload(data, SIDE)  # no budget: decode_table marks what the server would refuse
        result["estimate_mib"] = cost / 2**20
        square_of(image, SIDE)

    began = time.perf_counter()
    worker = threading.Thread(target=run)  # the server decodes in a thread of its pool
    worker.start()
    worker.join()
    result.update(seconds=time.perf_counter() - began, peak_mib=status("VmHWM") - before,
                  kept_mib=status("VmRSS") - before)
    return result


def decode_table(budget_mib: float = 512) -> None:
    print(f"\nsquashed to {SIDE} px\n\n| upload | file | estimate (MiB) | peak (MiB) | kept after (MiB) | seconds |\n"
          "|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name, path in largest_uploads(Path(folder)).items():
            out = subprocess.run([sys.executable, __file__, "--decode-one", str(path)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            refused = " (over the default budget: 413)" if r["estimate_mib"] > budget_mib else ""
            print(f"| {name}{refused} | {r['bytes'] / 1e6:.2f} MB | {r['estimate_mib']:.0f} | {r['peak_mib']:.0f} "
                  f"| {r['kept_mib']:.0f} | {r['seconds']:.2f} |", flush=True)


def serve_and_load(options: argparse.Namespace, images: list[bytes]) -> list[dict]:
    """Each window's runs, the windows in alternating order from one repeat to the next."""
    servers: dict[float, Server] = {}
    try:
        if options.url:
            info = json.loads(get(options.url, "/info")[1])
            urls = {float(info.get("batch_window_ms", float("nan"))): options.url.rstrip("/")}
        else:
            servers = {float(w): Server(options.ckpt_path, float(w), options.max_batch_size)
                       for w in options.windows.split(",")}
            urls = {w: server.wait_ready() for w, server in servers.items()}
        runs = []
        for repeat in range(options.repeats):
            for window in list(urls) if repeat % 2 == 0 else list(reversed(urls)):
                load(urls[window], images, WARMUP, min(options.clients, WARMUP))
                run = load(urls[window], images, options.requests, options.clients)
                runs.append({"window_ms": window, "repeat": repeat, **run})
                print(f"window {window:g} ms, repeat {repeat + 1}: p50 {run['p50_ms']:.1f} ms, p99 "
                      f"{run['p99_ms']:.1f} ms, {run['requests_per_s']:.0f} requests/s, {run['errors']} errors "
                      f"{run['first_errors'] or ''}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return sorted(runs, key=lambda run: (run["window_ms"], run["repeat"]))


def main(args: list[str] | None = None) -> int:
    options = parser().parse_args(args)
    if options.decode_one:
        print(json.dumps(decode_one(options.decode_one)))
        return 0
    if options.decode:
        print(cpu())
        decode_table()
        return 0
    images = photos()
    runs = serve_and_load(options, images)
    print(f"\n{cpu()}; {len(images)} JPEGs of {sum(map(len, images)) // len(images) // 1000} kB on average\n")
    print(table(runs))
    if options.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()}
        options.json.write_text(json.dumps({"config": config, "cpu": cpu(), "runs": runs}, indent=2) + "\n")
    return 1 if any(run["errors"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
