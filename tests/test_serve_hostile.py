"""flowers serve against hostile clients: images that cost gigabytes to decode, stalled and vanishing clients, and
more uploads than it takes at once. Against the shared server of tests/conftest.py (its limits are small on
purpose), its HTTP process's memory read from /proc."""

from __future__ import annotations

import io
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from tests.helpers.serving import (
    DECODE_BUDGET_MB,
    MAX_UPLOADS,
    SIDE,
    assert_one_line_error,
    httpx,
    jpeg_photo,
    memory_mib,
    photo_files,
    png_of,
    post_raw,
    process_named,
    raw_upload,
    read_all,
    reset_peak,
)

MIB = 2**20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads memory figures from /proc")


@pytest.fixture(scope="module")
def deep_png() -> bytes:
    """A 16-bit grayscale PNG of 9,400 x 9,400 in about 1 MB: 177 MB of pixels, 265 MB to decode to 8 bits."""
    return png_of(SIDE, SIDE, 16, 0, b"\x00" + (np.arange(SIDE, dtype=">u2") * 7).tobytes())


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> bytes:
    return next(iter(photo_files(tmp_path_factory.mktemp("photos")))).read_bytes()  # a JPEG


@pytest.fixture
def http_process(served):
    """The PID of the shared server's HTTP process, warmed up by one small request."""
    assert post_raw(served.url, jpeg_photo(120, 90), "image/jpeg").status_code == 200
    return process_named(served.process.pid, "flowers-http")


def test_an_88_megapixel_16_bit_png_decodes_within_its_estimate_and_gives_the_memory_back(served, http_process,
                                                                                          deep_png):
    before = memory_mib(http_process, "VmRSS")
    reset_peak(http_process)
    response = post_raw(served.url, deep_png, "image/png")
    assert response.status_code == 200, response.text
    peak = memory_mib(http_process, "VmHWM") - before
    after = memory_mib(http_process, "VmRSS") - before
    # 177 MB as PIL stores it plus 88 MB at 8 bits, no float copy (a float64 copy alone would be 707 MB).
    assert peak < 330, f"decoding took {peak:.0f} MiB at its peak"
    assert after < 48, f"the HTTP process kept {after:.0f} MiB after the answer"


def test_a_burst_of_large_images_queues_for_the_decode_budget(served, http_process, deep_png):
    before = memory_mib(http_process, "VmRSS")
    reset_peak(http_process)
    responses: list[httpx.Response | None] = [None] * 4
    start = threading.Barrier(len(responses))

    def client(i: int) -> None:
        start.wait()
        # Three large images at once, and a small photo among them, which need not wait for them.
        data, kind = (jpeg_photo(640, 480), "image/jpeg") if i == 3 else (deep_png, "image/png")
        responses[i] = post_raw(served.url, data, kind)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(responses))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    peak = memory_mib(http_process, "VmHWM") - before
    # 265 MB each: the budget of 400 MiB lets one decode at a time, not three (800 MB) at once.
    assert peak < DECODE_BUDGET_MB, f"the burst took {peak:.0f} MiB at its peak"


def test_an_image_that_needs_more_than_the_whole_budget_is_refused_from_its_header(served):
    # An RGBA PNG of 9,400 x 9,400 needs about 800 MB to decode and composite on white; its pixels needn't exist.
    header_only = png_of(SIDE, SIDE, 8, 6, b"\x00" * 64, idat=False)
    response = post_raw(served.url, header_only, "image/png")
    assert_one_line_error(response, 413, "over the decode budget")
    assert "--decode_budget_mb" in response.json()["error"] and "9400 x 9400" in response.json()["error"]


def test_a_48_megapixel_phone_photo_decodes_reduced(served, http_process):
    photo = jpeg_photo(8000, 6000)
    before = memory_mib(http_process, "VmRSS")
    reset_peak(http_process)
    response = post_raw(served.url, photo, "image/jpeg")
    assert response.status_code == 200, response.text
    peak = memory_mib(http_process, "VmHWM") - before
    assert peak < 48, f"a 48 MP JPEG took {peak:.0f} MiB at its peak (192 MB decoded whole)"


def log_lines(served) -> list[str]:
    return served.log.read_text(errors="replace").splitlines()


def wait_for_log(served, count: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(log_lines(served)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return log_lines(served)


def test_a_stalled_body_is_answered_408_and_cut_off(served):
    seen = len(log_lines(served))
    with raw_upload(served.url, 100_000, b"\xff\xd8 only the first bytes") as connection:
        answer = read_all(connection)  # returns once the server closes the connection
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'{"error":' in answer and b"--body_timeout_s" in answer
    new = wait_for_log(served, seen + 1)[seen:]
    assert len(new) == 1 and "--body_timeout_s" in new[0], new


def test_stalled_request_headers_are_cut_off(served):
    seen = len(log_lines(served))
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"POST /predict HTTP/1.1\r\nHost: test\r\n")  # and never the rest
        assert read_all(connection) == b""  # closed at --body_timeout_s, before the socket's 30 s
    new = wait_for_log(served, seen + 1)[seen:]
    assert len(new) == 1 and "no complete request headers" in new[0], new


def test_clients_that_go_away_mid_upload_cost_one_log_line_each(served, photo):
    seen = len(log_lines(served))
    for _ in range(3):
        connection = raw_upload(served.url, 100_000, b"\xff\xd8 the start of a photo")
        time.sleep(0.2)  # the server is reading the body now
        connection.close()
    new = wait_for_log(served, seen + 3)[seen:]
    assert len(new) == 3 and all("went away" in line for line in new), new
    assert post_raw(served.url, photo, "image/jpeg").status_code == 200


def test_uploads_over_the_cap_are_answered_503_at_once(served, photo):
    seen = len(log_lines(served))
    stalled = [raw_upload(served.url, 100_000, b"\xff\xd8") for _ in range(MAX_UPLOADS)]
    try:
        time.sleep(0.5)  # all of them are being read now
        refused = post_raw(served.url, photo, "image/jpeg")
        assert_one_line_error(refused, 503, "over --max_uploads")
        assert "--max_uploads" in refused.json()["error"] and refused.headers["retry-after"]
    finally:
        for connection in stalled:
            connection.close()
    wait_for_log(served, seen + MAX_UPLOADS)  # their slots are free once each is seen gone
    assert post_raw(served.url, photo, "image/jpeg").status_code == 200


def test_number_options_refuse_nan_infinity_and_out_of_range_in_one_sentence(tmp_path, capsys):
    from flowers.serve import main

    missing = str(tmp_path / "missing.ckpt")  # the numbers are checked first
    for option in ("--batch_window_ms", "--max_body_mb", "--body_timeout_s", "--decode_budget_mb"):
        for value in ("nan", "inf", "-inf", "-1"):
            assert main(["--ckpt_path", missing, f"{option}={value}"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"flowers serve: error: {option} must be a finite number of "), err
            assert err.endswith(f"got {float(value)}.\n") and err.count("\n") == 1, err  # one sentence, one line
    for option, value in (("--port", "99999"), ("--max_uploads", "0"), ("--batch_window_ms", "600000")):
        assert main(["--ckpt_path", missing, option, value]) == 2
        assert capsys.readouterr().err.startswith(f"flowers serve: error: {option} must be ")


def test_a_ckpt_path_that_is_neither_a_file_nor_a_folder_is_refused_at_once(tmp_path, capsys):
    from flowers.serve import main

    fifo = tmp_path / "model.ckpt"
    os.mkfifo(fifo)  # reading it would wait forever for a writer
    assert main(["--ckpt_path", str(fifo)]) == 2
    assert "neither a regular file nor a folder" in capsys.readouterr().err


def test_the_square_has_load_rgbs_pixels_squashed_in_every_mode(tmp_path):
    from flowers.data.images import load_rgb_bytes
    from flowers.serve.uploads import decode_upload

    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 256, (70, 110, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (70, 110, 4), dtype=np.uint8))
    rotated = Image.Exif()
    rotated[0x0112] = 6
    images = {
        "RGB": (rgb, {}), "L": (rgb.convert("L"), {}), "1": (rgb.convert("1"), {}), "P": (rgb.convert("P"), {}),
        "P transparent": (rgb.convert("P"), {"transparency": 3}), "RGBA": (rgba, {}), "LA": (rgba.convert("LA"), {}),
        "16-bit": (Image.fromarray(rng.integers(0, 65536, (70, 110), dtype=np.uint16)), {}),
        "rotated": (rgb.convert("L"), {"exif": rotated}),
    }
    for name, (image, options) in images.items():
        buffer = io.BytesIO()
        image.save(buffer, "PNG", **options)
        data = buffer.getvalue()
        for side in (32, 64, 150):
            expected = np.asarray(load_rgb_bytes(data).resize((side, side), Image.Resampling.BILINEAR))
            assert np.array_equal(decode_upload(data, side), expected), (name, side)


def test_sixteen_and_32_bit_grayscale_become_8_bits_as_value_over_257_rounded(tmp_path):
    from flowers.data.images import load_rgb

    values = np.array([[0, 128, 129, 385, 40000, 65535]], dtype=np.uint16)
    for array in (values, values.astype(np.int32), np.array([[-7, 3, 255, 70_000, 2**31 - 1, 0]], np.int32)):
        path = tmp_path / "deep.tif"
        Image.fromarray(array).save(path)
        scale = 257 if array.dtype == np.uint16 or array.max() > 255 else 1
        expected = np.clip(np.round(array / scale), 0, 255).astype(np.uint8)
        assert np.array_equal(np.asarray(load_rgb(str(path)))[..., 0], expected), array
