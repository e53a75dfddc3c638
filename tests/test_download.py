"""Downloading the flower photos, against a local HTTP server: no test touches the internet."""

import hashlib
import http.server
import io
import multiprocessing
import tarfile
import threading
import time
from pathlib import Path

import pytest

from flowers.data.download import fetch_flower_photos
from flowers.errors import DataError
from tests.helpers.images import make_tree
from tests.helpers.runs import TINY_RUN

CLASSES = {"daisy": 6, "roses": 6}


class ArchiveServer(http.server.ThreadingHTTPServer):
    """Serves ``archives[path]``, counts the requests, and can cut a response off half-way."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.archives: dict[str, bytes] = {}
        self.requests = 0
        self.cut_off = False
        self.delay_s = 0.0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        server = self.server
        server.requests += 1
        body = server.archives.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        time.sleep(server.delay_s)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # A cut-off transfer: the full length is announced, half of it is sent, the connection closes.
        self.wfile.write(body[: len(body) // 2] if server.cut_off else body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ArchiveServer()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _tgz(add) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        add(archive)
    return buffer.getvalue()


def flower_archive(tmp_path: Path) -> bytes:
    """The real archive's layout: flower_photos/<class>/*.jpg and flower_photos/LICENSE.txt."""
    source = make_tree(tmp_path / "source" / "flower_photos", CLASSES)
    (source / "LICENSE.txt").write_text("All images in this archive are licensed under CC-BY 2.0.\n")
    return _tgz(lambda archive: archive.add(source, arcname="flower_photos"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def serve(server, name: str, data: bytes) -> tuple[str, str]:
    server.archives[name] = data
    return server.url(name), sha256(data)


def leftovers(parent: Path) -> list[str]:
    # The lock file is meant to stay; anything else next to the target is debris.
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".lock"))


def test_download_verifies_extracts_and_a_second_run_makes_no_request(server, tmp_path):
    url, digest = serve(server, "flower_photos.tgz", flower_archive(tmp_path))
    target = tmp_path / "data" / "flower_photos"
    root = fetch_flower_photos(target, url=url, sha256=digest)
    assert root == target
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["daisy", "roses"]
    assert len(list((root / "daisy").glob("*.jpg"))) == 6
    assert (root / "LICENSE.txt").is_file()
    assert leftovers(target.parent) == ["flower_photos"]  # no archive, no temporary folder
    assert server.requests == 1
    assert fetch_flower_photos(target, url=url, sha256=digest) == target
    assert server.requests == 1


def test_checksum_mismatch_is_refused_and_leaves_nothing(server, tmp_path):
    url, _ = serve(server, "flower_photos.tgz", flower_archive(tmp_path))
    target = tmp_path / "data" / "flower_photos"
    with pytest.raises(DataError, match=r"SHA-256 .* not the expected 0{64}") as error:
        fetch_flower_photos(target, url=url, sha256="0" * 64)
    assert url in str(error.value)
    assert leftovers(target.parent) == []


def test_a_cut_off_download_leaves_nothing_and_a_retry_succeeds(server, tmp_path):
    url, digest = serve(server, "flower_photos.tgz", flower_archive(tmp_path))
    target = tmp_path / "data" / "flower_photos"
    server.cut_off = True
    with pytest.raises(DataError, match="Could not download .* nothing was left") as error:
        fetch_flower_photos(target, url=url, sha256=digest)
    assert url in str(error.value)
    assert leftovers(target.parent) == []
    server.cut_off = False
    assert (fetch_flower_photos(target, url=url, sha256=digest) / "roses").is_dir()


def test_an_unreachable_url_is_a_clear_error(server, tmp_path):
    with pytest.raises(DataError, match="404"):
        fetch_flower_photos(tmp_path / "flower_photos", url=server.url("missing.tgz"), sha256=None)
    assert leftovers(tmp_path) == []


def _with(name: str, *, kind=tarfile.REGTYPE, linkname: str = "", data: bytes = b"evil"):
    def add(archive):
        member = tarfile.TarInfo(name)
        member.type, member.linkname = kind, linkname
        member.size = len(data) if kind == tarfile.REGTYPE else 0
        archive.addfile(member, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return add


@pytest.mark.parametrize(
    ("add", "why"),
    [
        (_with("flower_photos/../../escaped.txt"), "'..' path"),
        (_with("/tmp/flowers-absolute-escape.txt"), "absolute path"),
        (_with("flower_photos/daisy/link", kind=tarfile.SYMTYPE, linkname="/etc"), "absolute path '/etc'"),
        (_with("flower_photos/link", kind=tarfile.SYMTYPE, linkname="../../outside"), "pointing out"),
        (_with("flower_photos/hard", kind=tarfile.LNKTYPE, linkname="../outside"), "pointing out"),
    ],
    ids=["dotdot", "absolute", "symlink-absolute", "symlink-outward", "hardlink-outward"],
)
def test_archives_that_would_write_outside_the_target_are_refused(server, tmp_path, add, why):
    # A benign class folder first, so refusing is not just "the archive is empty".
    def archive(tar):
        folder = tarfile.TarInfo("flower_photos/daisy")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        add(tar)
    url, digest = serve(server, "evil.tgz", _tgz(archive))
    target = tmp_path / "deep" / "data" / "flower_photos"
    with pytest.raises(DataError, match=f"Refusing to extract {url}: its member .* is .*{why}"):
        fetch_flower_photos(target, url=url, sha256=digest)
    assert leftovers(target.parent) == []
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not Path("/tmp/flowers-absolute-escape.txt").exists()


def _fetch_in_child(target: str, url: str, digest: str, start) -> None:
    start.wait(timeout=120)  # both children have imported everything: now they ask at the same moment
    fetch_flower_photos(target, url=url, sha256=digest)


def test_two_processes_asking_at_once_download_once(server, tmp_path):
    url, digest = serve(server, "flower_photos.tgz", flower_archive(tmp_path))
    server.delay_s = 1.0  # the second process arrives while the first holds the lock
    target = str(tmp_path / "data" / "flower_photos")
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(2)
    children = [spawn.Process(target=_fetch_in_child, args=(target, url, digest, start)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0]
    assert server.requests == 1
    assert (Path(target) / "daisy").is_dir()


def test_fit_downloads_through_the_cli_and_trains(server, tmp_path, in_tmp):
    from flowers.cli import cli_main  # here, not at the top: the spawned children of the test above import us
    url, digest = serve(server, "x.tgz", flower_archive(tmp_path))
    target = in_tmp / "photos"
    cli = cli_main([
        "fit", *TINY_RUN, "--data.download=true", f"--data.download_url={url}",
        f"--data.download_sha256={digest}", f"--data.data_dir={target}",
    ])
    assert cli.datamodule.class_names == ["daisy", "roses"]
    assert cli.model.hparams.class_names == ["daisy", "roses"]
    assert cli.trainer.global_step >= 1
    assert server.requests == 1


def test_a_bad_checksum_through_the_cli_is_one_paragraph(server, tmp_path, in_tmp, capsys):
    from flowers.cli import main

    url, _ = serve(server, "x.tgz", flower_archive(tmp_path))
    code = main(["fit", *TINY_RUN, "--data.download=true", f"--data.download_url={url}",
                 f"--data.download_sha256={'1' * 64}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "flowers: error: The archive downloaded from" in err and "Traceback" not in err
    assert not (in_tmp / "data" / "flower_photos").exists()  # the default target stays empty


def test_the_download_subcommand_downloads_and_says_where(server, tmp_path, capsys):
    from flowers.__main__ import main as flowers

    def main(args: list[str]) -> int:
        return flowers(["download", *args])  # `flowers download`, which `make data` runs

    url, digest = serve(server, "flower_photos.tgz", flower_archive(tmp_path))
    target = tmp_path / "data" / "flower_photos"
    assert main(["--dir", str(target), "--url", url, "--sha256", digest]) == 0
    assert f"The flower photos are in {target} (2 classes: daisy, roses)" in capsys.readouterr().out
    assert main(["--dir", str(target), "--url", url, "--sha256", "f" * 64]) == 0  # already there: no request
    assert server.requests == 1
    assert main(["--dir", str(tmp_path / "other"), "--url", url, "--sha256", "f" * 64]) == 2
    assert "flowers: error: The archive downloaded from" in capsys.readouterr().err
