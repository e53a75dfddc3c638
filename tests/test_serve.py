"""flowers serve: a real server process on a free port of 127.0.0.1, talked to over HTTP, answering as ``predict``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowers.__main__ import main as flowers_main
from flowers.__main__ import overview
from flowers.analysis import image_size_of, load, predict
from flowers.data.images import load_rgb, load_rgb_bytes
from tests.helpers.runs import best_checkpoint
from tests.helpers.serving import (
    TOP_K,
    Server,
    assert_one_line_error,
    bilevel_png,
    httpx,
    jpeg_photo,
    photo_files,
    post_raw,
    stop_all,
)

pytest.importorskip("litserve", reason="flowers serve runs on LitServe (pip install -e '.[serve]')")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ckpt(mirror_run) -> Path:
    return mirror_run / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[Path, str]:
    return photo_files(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def reference(ckpt, photos) -> dict[Path, dict]:
    """``flowers.analysis.predict``'s rows for the photos: the numbers the server must give."""
    model, _, _ = load(ckpt)
    rows = predict(model, list(photos), top_k=TOP_K, image_size=image_size_of(ckpt))
    return {Path(row["path"]): row for row in rows}


def assert_same_answer(answer: dict, row: dict) -> None:
    assert set(answer) == {"prediction", "top"}
    assert answer["prediction"] == row["prediction"] == answer["top"][0]["class"]
    assert [t["class"] for t in answer["top"]] == [t["class"] for t in row["top_k"]]
    np.testing.assert_allclose([t["probability"] for t in answer["top"]], [t["prob"] for t in row["top_k"]],
                               rtol=0, atol=1e-5)


def test_predict_answers_as_flowers_predict_for_raw_bytes_and_a_multipart_form(served, ckpt, photos, reference):
    for path, content_type in photos.items():
        raw = post_raw(served.url, path.read_bytes(), content_type)
        assert raw.status_code == 200, raw.text
        assert_same_answer(raw.json(), reference[path])
        form = httpx.post(f"{served.url}/predict", files={"file": (path.name, path.read_bytes())}, timeout=60)
        assert form.status_code == 200, form.text
        assert_same_answer(form.json(), reference[path])
    # Without the mirror images the numbers differ: the server's agreement above is not by chance.
    plain, _, _ = load(ckpt)
    plain.eval_hflip = False
    rows = predict(plain, list(photos), top_k=5, image_size=image_size_of(ckpt))
    mirrored = predict(load(ckpt)[0], list(photos), top_k=5, image_size=image_size_of(ckpt))
    pairs = zip(rows, mirrored, strict=True)
    assert max(abs(a["probs"][c] - b["probs"][c]) for a, b in pairs for c in a["probs"]) > 1e-4


def test_health_info_and_the_page(served, ckpt):
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200
    info = httpx.get(f"{served.url}/info").json()
    assert info["classes"] == ["daisy", "dandelion", "rose", "sunflower", "tulip"]
    assert info["image_size"] == 64  # the run's data.image_size, from its config.yaml
    assert info["checkpoint"] == str(ckpt) and info["format"] == "checkpoint"
    assert info["backbone"] == "tutorial_alexnet" and info["eval_hflip"] is True
    assert info["normalization"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert info["top_k"] == TOP_K and info["max_body_bytes"] == 20 * 2**20
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<input id="file" type="file"' in page.text and 'fetch("predict"' in page.text


def bad_requests(photo: bytes) -> list[tuple[str, int, dict]]:
    side = 10_000  # 100 M pixels, over PIL's 89 M: a valid 12 kB file that would decode to 300 MB of RGB
    bomb = bilevel_png(side, side, (b"\x00" + bytes(side // 8)) * side)
    over = os.urandom(20 * 2**20 + 1)
    return [
        ("not an image", 422, {"content": b"just some text, no pixels", "headers": {"Content-Type": "image/jpeg"}}),
        ("a truncated JPEG", 422, {"content": photo[: len(photo) // 2], "headers": {"Content-Type": "image/jpeg"}}),
        ("a decompression bomb", 413, {"content": bomb, "headers": {"Content-Type": "image/png"}}),
        ("20,000 x 20,000 pixels", 413, {"content": bilevel_png(20_000, 20_000, b"\x00" * 2501),
                                         "headers": {"Content-Type": "image/png"}}),
        ("an empty body", 400, {"content": b"", "headers": {"Content-Type": "image/jpeg"}}),
        ("an empty file field", 400, {"files": {"file": ("empty.jpg", b"")}}),
        ("a form without 'file'", 400, {"files": {"photo": ("a.jpg", photo)}}),
        ("a form with no boundary", 400, {"content": photo, "headers": {"Content-Type": "multipart/form-data"}}),
        ("text/plain", 415, {"content": photo, "headers": {"Content-Type": "text/plain"}}),
        ("JSON", 415, {"content": b'{"image": "..."}', "headers": {"Content-Type": "application/json"}}),
        ("curl's default form type", 415, {"content": photo,
                                           "headers": {"Content-Type": "application/x-www-form-urlencoded"}}),
        ("over 20 MiB", 413, {"content": over, "headers": {"Content-Type": "image/jpeg"}}),
        ("over 20 MiB, chunked", 413, {"content": iter([over[:2**20], over[2**20:]]),
                                       "headers": {"Content-Type": "image/jpeg"}}),
        ("over 20 MiB in a form", 413, {"files": {"file": ("big.jpg", over)}}),
    ]


def test_bad_requests_get_a_4xx_with_one_line_of_json_and_the_server_keeps_serving(served, photos, reference):
    photo_path = next(iter(photos))  # a JPEG
    photo = photo_path.read_bytes()
    with httpx.Client(base_url=served.url, timeout=60) as client:
        for what, status, request in bad_requests(photo):
            assert_one_line_error(client.post("/predict", **request), status, what)
        assert_one_line_error(client.get("/predict"), 405, "GET /predict")
        assert_one_line_error(client.get("/no/such/page"), 404, "an unknown path")
        good = client.post("/predict", content=photo, headers={"Content-Type": "image/jpeg"})
    assert good.status_code == 200, good.text
    assert_same_answer(good.json(), reference[photo_path])
    assert served.process.poll() is None


def test_concurrent_clients_share_forward_passes_and_get_their_own_answers(served, photos, reference):
    paths = list(photos) * 4
    start = threading.Barrier(len(paths))
    responses: list[httpx.Response | None] = [None] * len(paths)

    def client(i: int) -> None:
        data = paths[i].read_bytes()
        start.wait()
        responses[i] = post_raw(served.url, data, "application/octet-stream")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(paths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for path, response in zip(paths, responses, strict=True):
        assert response.status_code == 200, response.text
        assert_same_answer(response.json(), reference[path])  # each its own answer, batched with others or not
    sizes = [int(r.headers["X-Batch-Size"]) for r in responses]
    assert max(sizes) > 1, sizes  # 16 requests at once, a 100 ms window: some were answered by one forward pass
    assert max(sizes) <= 8  # --max_batch_size


@pytest.mark.parametrize(("window_s", "max_batch", "batches"),
                         [(0.0, 8, [3]), (0.05, 8, [3]), (1e-9, 8, [3]), (0.0, 2, [2, 1])],
                         ids=["window 0", "50 ms", "closed before the queue is read", "max batch 2"])
def test_the_batching_loop_takes_what_is_queued_and_never_drops_a_request(window_s, max_batch, batches):
    from queue import Queue
    from types import SimpleNamespace

    from flowers.serve.server import WindowedLoop

    requests = Queue()
    for i in range(3):
        requests.put((0, f"uid{i}", time.monotonic(), i))
    api = SimpleNamespace(batch_timeout=window_s, max_batch_size=max_batch, request_timeout=30, stream=False)
    loop, seen, sizes = WindowedLoop(), [], []
    for _ in range(len(batches)):
        batch, timed_out = loop.get_batch_requests(api, requests, transport=None)
        assert timed_out == []
        seen += [uid for _, uid, _ in batch]
        sizes.append(len(batch))
    assert seen == ["uid0", "uid1", "uid2"] and sizes == batches


def test_the_batching_window_waits_for_a_request_that_comes_later():
    from queue import Queue
    from types import SimpleNamespace

    from flowers.serve.server import WindowedLoop

    requests = Queue()
    requests.put((0, "early", time.monotonic(), None))
    later = threading.Timer(0.05, lambda: requests.put((0, "later", time.monotonic(), None)))
    later.start()
    api = SimpleNamespace(batch_timeout=60.0, max_batch_size=2, request_timeout=30, stream=False)
    batch, _ = WindowedLoop().get_batch_requests(api, requests, transport=None)  # ends once the batch is full
    assert [uid for _, uid, _ in batch] == ["early", "later"]
    stale = SimpleNamespace(batch_timeout=0.0, max_batch_size=2, request_timeout=30, stream=False)
    requests.put((0, "stale", time.monotonic() - 31, None))  # queued longer than LitServe's 30 s timeout
    assert WindowedLoop().get_batch_requests(stale, requests, transport=None) == ([], [(0, "stale")])


def test_it_listens_on_127_0_0_1_only_by_default(served):
    table = Path("/proc/net/tcp")
    if not table.is_file():
        pytest.skip("no /proc/net/tcp to read the listening addresses from (not Linux)")
    listening = set()
    for line in [*table.read_text().splitlines()[1:], *_lines(Path("/proc/net/tcp6"))]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(":")
        if state == "0A" and int(port, 16) == served.port:  # 0A: LISTEN
            listening.add(address)
    assert listening == {"0100007F"}, listening  # 127.0.0.1, little-endian hex


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()[1:] if path.is_file() else []


def test_an_onnx_export_is_served_with_the_checkpoints_numbers(onnx_served, photos, reference):
    info = httpx.get(f"{onnx_served.url}/info").json()
    assert info["format"] == "onnx" and info["checkpoint"].endswith(".onnx")
    assert info["image_size"] == 64 and info["eval_hflip"] is True  # the run's config.yaml, two folders up
    for path, content_type in photos.items():
        response = post_raw(onnx_served.url, path.read_bytes(), content_type)
        assert response.status_code == 200, response.text
        assert_same_answer(response.json(), reference[path])


def test_a_torchscript_export_predicts_as_its_checkpoint(ckpt, photos, reference, tmp_path):
    from flowers.export import export
    from flowers.serve.model import Predictor, describe
    from flowers.serve.uploads import decode_upload

    target = export(ckpt, "torchscript", output=tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "config.yaml").write_text((ckpt.parents[1] / "config.yaml").read_text())  # beside it
    source = describe(target)
    assert (source.format, source.image_size, source.eval_hflip) == ("torchscript", 64, True)
    predictor = Predictor(source)
    for path in photos:
        probs = predictor.probabilities(predictor.tensor(decode_upload(path.read_bytes(), 64))[None])[0]
        assert_same_answer(predictor.top(probs, TOP_K), reference[path])


def test_a_large_jpeg_decodes_reduced_and_keeps_predicts_answer(ckpt, tmp_path):
    from flowers.data.synthetic import draw_flower
    from flowers.serve.model import Predictor, describe
    from flowers.serve.uploads import decode_upload, open_upload

    rng, paths = np.random.default_rng(11), []
    for label in range(5):  # 1,920 px a side: libjpeg decodes it at 1/8, still over twice the model's 64 px
        paths.append(tmp_path / f"large-{label}.jpg")
        draw_flower(label, rng, size=240).resize((1920, 1920), Image.Resampling.LANCZOS).save(paths[-1], quality=92)
    rows = predict(load(ckpt)[0], paths, top_k=5, image_size=64)  # predict decodes the whole photo
    predictor = Predictor(describe(ckpt))
    for path, row in zip(paths, rows, strict=True):
        data = path.read_bytes()
        assert open_upload(data, 64)[0].size == (240, 240)
        square = decode_upload(data, 64)
        whole = np.asarray(load_rgb(str(path)).resize((64, 64), Image.Resampling.BILINEAR))
        assert 0 < np.abs(square.astype(int) - whole).max() <= 4  # reduced, yet within a few levels of each pixel
        answer = predictor.top(predictor.probabilities(predictor.tensor(square)[None])[0], 5)
        assert answer["prediction"] == row["prediction"]
        assert max(abs(t["probability"] - row["probs"][t["class"]]) for t in answer["top"]) < 0.002
    small = jpeg_photo(120, 90)  # its shorter side under twice the model's: decoded whole, exactly predict's pixels
    expected = np.asarray(load_rgb_bytes(small).resize((64, 64), Image.Resampling.BILINEAR))
    assert open_upload(small, 64)[0].size == (120, 90) and np.array_equal(decode_upload(small, 64), expected)


def test_load_rgb_bytes_gives_the_pixels_load_rgb_gives(photos, tmp_path):
    rotated = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90°
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 80, 3), dtype=np.uint8)).save(rotated, exif=exif)
    wide = tmp_path / "16bit.png"
    Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)).save(wide)
    for path in [*photos, rotated, wide]:
        from_bytes = load_rgb_bytes(path.read_bytes())
        assert from_bytes.mode == "RGB"
        assert np.array_equal(np.asarray(from_bytes), np.asarray(load_rgb(str(path)))), path
    assert load_rgb_bytes(rotated.read_bytes()).size == (40, 80)
    with pytest.raises(Image.DecompressionBombError):
        load_rgb_bytes(bilevel_png(10_000, 10_000, (b"\x00" + bytes(1250)) * 10_000))


def test_best_and_last_name_the_newest_runs_checkpoints(trained_run, tmp_path, monkeypatch):
    from flowers.errors import ConfigError
    from flowers.serve.model import find_model

    run = trained_run
    monkeypatch.chdir(run.parents[2])  # where `fit` ran: runs/flowers/version_0 lies below
    assert find_model("best").resolve() == best_checkpoint(run).resolve()
    assert find_model("last").resolve() == (run / "checkpoints" / "last.ckpt").resolve()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"no runs/flowers/version_\*/checkpoints/ holds a checkpoint here"):
        find_model("best")


def _refusal(capsys, *args: str) -> str:
    from flowers.serve import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowers serve: error: ") and "Traceback" not in err
    return err


def test_the_command_refuses_bad_arguments_in_one_paragraph(ckpt, tmp_path, capsys):
    assert "does not exist" in _refusal(capsys, "--ckpt_path", str(tmp_path / "missing.ckpt"))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert "as a checkpoint" in _refusal(capsys, "--ckpt_path", str(garbage))
    weights = tmp_path / "AlexNet.pth"
    weights.write_bytes(b"")
    assert "state_dict holds no network" in _refusal(capsys, "--ckpt_path", str(weights))
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(b"not a graph")
    assert "class_indices.json is missing" in _refusal(capsys, "--ckpt_path", str(export))
    shutil.copy(ckpt.parent / "class_indices.json", export)
    assert "could not be loaded as an ONNX export" in _refusal(capsys, "--ckpt_path", str(export / "model.onnx"))
    assert "binds 127.0.0.1" in _refusal(capsys, "--ckpt_path", str(ckpt), "--host", "192.0.2.1")
    assert "at least 1" in _refusal(capsys, "--ckpt_path", str(ckpt), "--top_k", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert f"port {port} on 127.0.0.1 can't be used" in _refusal(capsys, "--ckpt_path", str(ckpt), "--port", port)


def test_flowers_serve_is_a_subcommand_of_the_command_line(tmp_path, capsys):
    assert "\n    serve " in overview().format_help()
    assert flowers_main(["serve", "--ckpt_path", str(tmp_path / "no.ckpt")]) == 2
    assert capsys.readouterr().err.startswith("flowers serve: error: --ckpt_path")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_load_benchmark_runs_a_fixed_number_of_requests_without_errors(served, tmp_path):
    out = tmp_path / "load.json"
    assert load_benchmark().main(["--url", served.url, "--requests", "48", "--clients", "6", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["requests"] == 48 and run["errors"] == 0 and run["clients"] == 6 and run["window_ms"] == 100
    assert 0 < run["p50_ms"] <= run["p99_ms"] and run["requests_per_s"] > 0
    assert sum(run["batch_sizes"].values()) == 48  # responses by the size of the batch that answered them


@pytest.mark.slow
def test_the_load_benchmark_serves_each_window_itself_and_stops_its_servers(ckpt, tmp_path):
    out = tmp_path / "load.json"
    assert load_benchmark().main(["--ckpt_path", str(ckpt), "--windows", "0,5", "--requests", "64", "--clients", "8",
                                  "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(run["window_ms"], run["requests"], run["errors"]) for run in runs] == [(0, 64, 0), (5, 64, 0)]


@pytest.mark.slow
def test_ctrl_c_or_kill_stops_every_process_of_the_server(ckpt, tmp_path):
    servers = [Server(["--ckpt_path", str(ckpt)], tmp_path / f"serve-{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_ready()
        os.killpg(servers[0].process.pid, signal.SIGINT)  # Ctrl-C in a terminal: every process of the group
        servers[1].process.send_signal(signal.SIGTERM)  # `kill PID`: the command's own process only
        for server in servers:
            assert server.process.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while servers and time.monotonic() < deadline:
            try:
                os.killpg(servers[0].process.pid, 0)  # is anyone left in its group?
                time.sleep(0.2)
            except ProcessLookupError:
                assert "Traceback" not in servers[0].log.read_text()
                servers.pop(0).stop()
        assert not servers, "processes of the server outlived it"
    finally:
        stop_all(servers)
