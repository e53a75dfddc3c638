"""flowers serve when its inference worker dies (``kill -9``, as the kernel's out-of-memory killer does): a real
server, a real kill. The worker is restarted and the request it held is answered 503; a worker that dies again
before it has loaded the model stops the server with one line and exit status 1, for a supervisor."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.serving import Server, assert_one_line_error, httpx, photo_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker's PID in /proc")


@pytest.fixture(scope="session")
def checkpoint(mirror_run) -> Path:
    return mirror_run / "checkpoints" / "best.ckpt"


def workers(main: int) -> set[int]:
    """The PIDs of the inference workers of the server whose main process is ``main`` (LitServe spawns them)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == main and b"spawn_main" in command:
            found.add(int(entry.name))
    return found


def wait_until(check, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout} s")


def health(server: Server) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_request_it_held_gets_503(checkpoint, tmp_path):
    photo = next(iter(photo_files(tmp_path))).read_bytes()
    # A 5 s window for a batch of 2: a lone request waits in the worker, so a kill finds it there.
    server = Server(["--ckpt_path", str(checkpoint), "--batch_window_ms", "5000", "--max_batch_size", "2"],
                    tmp_path / "serve.log")
    try:
        server.wait_ready()
        main = server.process.pid
        (first,) = workers(main)
        answers: list[httpx.Response] = []

        def send() -> None:
            answers.append(httpx.post(f"{server.url}/predict", content=photo,
                                      headers={"Content-Type": "image/jpeg"}, timeout=60))

        held = threading.Thread(target=send)
        held.start()
        time.sleep(1.0)  # the worker has taken it, and waits for a second request to fill the batch
        os.kill(first, signal.SIGKILL)
        held.join(timeout=60)
        assert_one_line_error(answers[0], 503, "the request the dead worker held")
        assert "died" in answers[0].json()["error"]

        wait_until(lambda: health(server) == 503, "/health failing while the worker restarts", timeout=10)
        (second,) = wait_until(lambda: workers(main) - {first}, "a new worker")
        wait_until(lambda: health(server) == 200, "/health passing once the new worker is ready")
        both = [threading.Thread(target=send) for _ in range(2)]  # a full batch: answered without the window
        for thread in both:
            thread.start()
        for thread in both:
            thread.join(timeout=60)
        assert [a.status_code for a in answers[1:]] == [200, 200], [a.text for a in answers[1:]]
        assert server.process.poll() is None

        # Killed again, and its successor killed while it loads the model: the server stops, for a supervisor.
        os.kill(second, signal.SIGKILL)
        (third,) = wait_until(lambda: workers(main) - {first, second}, "a third worker")
        os.kill(third, signal.SIGKILL)
        assert server.process.wait(timeout=90) == 1
        log = server.log.read_text()
        assert "Traceback" not in log, log
        last = log.strip().splitlines()[-1]
        assert last.startswith("flowers serve: error: the inference worker was killed by SIGKILL") \
            and "before it had loaded the model" in last, log
    finally:
        server.stop()


def test_a_worker_killed_while_it_first_loads_the_model_stops_the_command_in_one_line(checkpoint, tmp_path):
    server = Server(["--ckpt_path", str(checkpoint)], tmp_path / "serve.log")
    try:
        (worker,) = wait_until(lambda: workers(server.process.pid), "the inference worker", timeout=120)
        os.kill(worker, signal.SIGKILL)
        assert server.process.wait(timeout=60) == 2  # LitServe alone waits for it forever
        log = server.log.read_text()
        assert "Traceback" not in log, log
        assert log.strip().splitlines()[-1].startswith("flowers serve: error: the model could not be loaded"), log
        assert "killed by SIGKILL" in log
    finally:
        server.stop()
