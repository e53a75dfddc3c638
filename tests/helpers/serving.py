"""``flowers serve`` as its users meet it: a real server process on a free port of 127.0.0.1, talked to over HTTP,
and the photos, hostile images and raw connections the tests send it."""

from __future__ import annotations

import io
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from flowers.data.synthetic import draw_flower
from tests.helpers.images import write_images
from tests.helpers.processes import free_port
from tests.helpers.runs import best_checkpoint

httpx = pytest.importorskip("httpx", reason="the serve tests talk HTTP with httpx (pip install -e '.[dev]')")

TOP_K = 3
# The shared checkpoint server's limits, small enough for the hostile-client tests to reach them quickly.
BODY_TIMEOUT_S = 3
MAX_UPLOADS = 20
DECODE_BUDGET_MB = 400
SIDE = 9_400  # 88 M pixels, under PIL's limit of 89 M: the largest square an upload may be


def mirror_copy(source: Path, run: Path) -> Path:
    """A copy of the run ``source`` at ``run`` with mirror-image evaluation (``eval_hflip``) on, in checkpoint and
    config; its checkpoint is ``run/checkpoints/best.ckpt``."""
    (run / "checkpoints").mkdir(parents=True)
    state = torch.load(best_checkpoint(source), map_location="cpu", weights_only=True)
    state["hyper_parameters"]["eval_hflip"] = True
    torch.save(state, run / "checkpoints" / "best.ckpt")
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["model"]["eval_hflip"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "checkpoints" / "class_indices.json").write_bytes(
        (source / "checkpoints" / "class_indices.json").read_bytes())
    return run


class Server:
    """``python -m flowers serve ARGS --port P`` in its own process group, its output in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "flowers", "serve", *args, "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"flowers serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"flowers serve was not ready within {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the command's SIGTERM handler stops its HTTP and worker processes
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        self.process.wait()


def stop_all(servers: list[Server]) -> None:
    for server in servers:
        if server.process.poll() is None:
            server.process.terminate()  # all at once: each takes a few seconds to shut down
    for server in servers:
        server.stop()


def photo_files(folder: Path) -> dict[Path, str]:
    """Photos and the Content-Type each is sent with: a JPEG, a PNG with transparency, a grayscale JPEG, and a drawn
    flower at a size the model doesn't use, sent as plain bytes."""
    noise = write_images(folder / "noise", 1)[0]
    rgba = folder / "clear.png"
    pixels = np.random.default_rng(1).integers(0, 256, (50, 80, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(rgba)
    gray = folder / "gray.jpg"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (90, 60), dtype=np.uint8), "L").save(gray)
    flower = folder / "rose.jpg"
    draw_flower(2, np.random.default_rng(3), size=180).save(flower, quality=90)
    return {noise: "image/jpeg", rgba: "image/png", gray: "image/jpeg", flower: "application/octet-stream"}


def post_raw(url: str, data: bytes, content_type: str) -> httpx.Response:
    return httpx.post(f"{url}/predict", content=data, headers={"Content-Type": content_type}, timeout=60)


def assert_one_line_error(response: httpx.Response, status: int, what: str) -> None:
    assert response.status_code == status, (what, response.status_code, response.text)
    assert "\n" not in response.text.strip() and "Traceback" not in response.text, what
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"], what


def bilevel_png(width: int, height: int, rows: bytes) -> bytes:
    """A 1-bit grayscale PNG of the given size whose pixel rows are ``rows``, compressed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def png_of(width: int, height: int, depth: int, color: int, row: bytes, *, idat: bool = True) -> bytes:
    """A PNG whose every pixel row is ``row`` (its filter byte first); with ``idat=False``, the header only."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0))
    if not idat:
        return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(row)) + chunk(b"IEND", b"")
    packer = zlib.compressobj(6)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def jpeg_photo(width: int, height: int) -> bytes:
    """A smooth photo-like JPEG of the given size, as a phone sends it."""
    small = np.random.default_rng(5).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def server_processes(root: int) -> dict[int, str]:
    """The server's processes, its main one included: PID -> name (``/proc/PID/comm``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    names = {}
    for pid in found:
        try:
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
    return names


def process_named(root: int, name: str) -> int:
    (pid,) = [pid for pid, comm in server_processes(root).items() if comm == name]
    return pid


def memory_mib(pid: int, field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (the peak since the last ``reset_peak``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the kernel starts VmHWM again from VmRSS


def raw_upload(url: str, declared: int, body: bytes) -> socket.socket:
    """A connection that sent a POST /predict's headers, saying ``declared`` bytes of body, then ``body`` only."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.sendall(b"POST /predict HTTP/1.1\r\nHost: test\r\nContent-Type: image/jpeg\r\n"
                       + f"Content-Length: {declared}\r\n\r\n".encode() + body)
    return connection


def read_all(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (at most 30 s, the socket's timeout)."""
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received
