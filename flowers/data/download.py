"""Fetching the TensorFlow ``flower_photos`` archive: download, verify, extract safely, rename into place.

Every step writes next to the target under a temporary name, and only the final ``os.replace`` makes
the target appear, so a run killed half-way never leaves a half dataset that a later run would trust.
A file lock (one process per machine, or per shared filesystem) downloads; the others wait for it and
then find the data in place. ``flowers download`` (``make data``) does the same from
the shell.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from flowers.errors import ArgumentParser, DataError
from flowers.files import build_once, can_create

log = logging.getLogger(__name__)

FLOWER_PHOTOS_URL = "https://storage.googleapis.com/download.tensorflow.org/example_images/flower_photos.tgz"
# 228,813,984 bytes; the value TensorFlow Datasets pins for this archive
# (tensorflow/datasets, tensorflow_datasets/url_checksums/tf_flowers.txt).
FLOWER_PHOTOS_SHA256 = "4c54ace7911aaffe13a365c34f650e71dd5bf1be0a58b464e5a7183e3e595d9c"
DEFAULT_DIR = "data/flower_photos"
MARKER = ".download.json"  # provenance, written into the extracted tree before it is renamed into place
CHUNK = 1 << 20
TIMEOUT_S = 60


def _is_ready(target: Path) -> bool:
    # Only os.replace makes the target appear, so any non-empty folder there is complete (or the
    # user's own copy of the photos, which is used as it is).
    if target.exists() and not target.is_dir():
        raise DataError(
            f"Cannot download the flower photos into {str(target)!r}: it exists and is not a folder. "
            "Remove it or download into another folder."
        )
    return target.is_dir() and any(target.iterdir())


def _cannot_download(url: str, target: Path, why: str) -> DataError:
    return DataError(
        f"Could not download the flower photos from {url} ({why}). Check the network and retry: nothing "
        f"was left in {str(target.parent)!r}, so the next run starts afresh. Without a network, download "
        f"the archive elsewhere, extract it and pass its flower_photos folder as --data.data_dir."
    )


def _download(url: str, part: Path, target: Path) -> str:
    """Stream ``url`` into ``part``; the SHA-256 of what arrived."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(part, "wb") as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            received, name = 0, url.rsplit("/", 1)[-1] or "download"
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name) as bar:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
    except http.client.IncompleteRead:
        raise _cannot_download(url, target, "the connection closed before the whole archive arrived") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as error:  # ValueError: no URL
        raise _cannot_download(url, target, str(error) or type(error).__name__) from None
    if total is not None and received != total:
        raise _cannot_download(url, target, f"got {received} of {total} bytes; the download was cut off")
    return digest.hexdigest()


def _verify(actual: str, expected: str | None, url: str) -> None:
    if expected is None:
        log.warning("Not verifying %s: --data.download_sha256 is unset.", url)
        return
    if actual.lower() != expected.strip().lower():
        raise DataError(
            f"The archive downloaded from {url} has SHA-256 {actual}, not the expected {expected}. It was "
            "deleted and nothing was extracted. Retry (a proxy or a broken transfer can corrupt it); if the "
            "archive really changed, check it and pass its checksum as --data.download_sha256."
        )


def _escapes(path: PurePosixPath) -> bool:
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return True
    return False


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why extracting ``member`` could write outside the target folder, or None."""
    name = PurePosixPath(member.name)
    if name.is_absolute() or member.name.startswith("\\") or (name.parts and ":" in name.parts[0]):
        return "an absolute path"
    if ".." in name.parts:
        return "a '..' path"
    if member.issym() or member.islnk():
        link = PurePosixPath(member.linkname)
        if link.is_absolute():
            return f"a link to the absolute path {member.linkname!r}"
        # A symlink resolves from its own folder, a hard link from the archive's root.
        if _escapes((name.parent if member.issym() else PurePosixPath()) / link):
            return f"a link pointing out of the archive (to {member.linkname!r})"
    elif not (member.isfile() or member.isdir()):
        return "a device, fifo or other special file"
    return None


def _checked_members(archive: tarfile.TarFile, source: str) -> list[tarfile.TarInfo]:
    members = archive.getmembers()
    for member in members:
        if why := _unsafe(member):
            raise DataError(
                f"Refusing to extract {source}: its member {member.name!r} is {why}, which could write "
                "outside the data folder. The archive is not the flower photos archive; nothing was extracted."
            )
    return members


def _extract(archive_path: Path, into: Path, source: str) -> None:
    try:
        with tarfile.open(archive_path, "r:*") as archive:
            members = _checked_members(archive, source)
            # The data filter (Python 3.10.12+/3.11.4+) re-checks every path and link and drops
            # permissions and owners that should not come from a download.
            if hasattr(tarfile, "data_filter"):
                archive.extractall(into, members=members, filter="data")
            else:
                archive.extractall(into, members=members)
    except DataError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        raise DataError(
            f"Could not extract the archive from {source} ({error}). It was deleted; retry the download."
        ) from None


def _tree_root(extracted: Path) -> Path:
    # The archive holds one folder (flower_photos/<class>/…, LICENSE.txt): that folder becomes the target.
    entries = [e for e in extracted.iterdir() if not e.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return extracted


def _fetch(folder: Path, target: Path, url: str, sha256: str | None) -> None:
    """Download, verify and extract the archive so that ``folder`` holds the class folders."""
    # Beside the folder and named after it: build_once removes what a killed download leaves.
    archive, extracted = folder.with_name(f"{folder.name}.tgz"), folder.with_name(f"{folder.name}.extracted")
    try:
        log.info("Downloading the flower photos from %s", url)
        _verify(_download(url, archive, target), sha256, url)
        extracted.mkdir()
        _extract(archive, extracted, url)
        archive.unlink()  # the archive is not kept: the extracted photos are all a run reads
        root = _tree_root(extracted)
        (root / MARKER).write_text(json.dumps({"url": url, "sha256": sha256}, indent=2) + "\n")
        folder.rmdir()  # the empty folder build_once made gives way to the archive's own
        os.replace(root, folder)
    finally:
        archive.unlink(missing_ok=True)
        shutil.rmtree(extracted, ignore_errors=True)


def check_source(url: str, sha256: str | None, url_flag: str = "--url", sha256_flag: str = "--sha256") -> None:
    """The address is one urllib can fetch and the checksum a SHA-256, before anything is created or downloaded."""
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https", "ftp", "file"):
        raise DataError(f"{url_flag} {url!r} is not an address the download can fetch: use an http://, https:// "
                        "or file:// URL of the archive.")
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256.strip()):
        raise DataError(f"{sha256_flag} {sha256!r} is not a SHA-256 (64 hexadecimal digits): pass the archive's "
                        "checksum, or none to skip the check.")


def fetch_flower_photos(
    target_dir: str | os.PathLike = DEFAULT_DIR, *, url: str = FLOWER_PHOTOS_URL,
    sha256: str | None = FLOWER_PHOTOS_SHA256,
) -> Path:
    """The class-folder root ``target_dir``, downloaded first unless it already holds data."""
    target = Path(target_dir).expanduser()
    if not _is_ready(target):
        if not can_create(target.parent):  # the lock and the download go beside the target
            raise DataError(f"Cannot download the flower photos into {str(target)!r}: {str(target.parent)!r} "
                            "cannot be written. Choose a folder you can write.")
        build_once(target, lambda folder: _fetch(folder, target, url, sha256), is_complete=_is_ready,
                   waiting_for="downloading")
        log.info("The flower photos are in %s", target)
    return target


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="flowers download", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"where the class folders go (default {DEFAULT_DIR})")
    p.add_argument("--url", default=FLOWER_PHOTOS_URL)
    p.add_argument("--sha256", default=FLOWER_PHOTOS_SHA256, help="expected SHA-256; 'none' skips the check")
    return p


def main(argv: list[str] | None = None) -> int:
    """``flowers download``."""
    args = parser().parse_args(argv)
    sha256 = None if args.sha256.lower() == "none" else args.sha256
    try:
        check_source(args.url, sha256)
        root = fetch_flower_photos(args.dir, url=args.url, sha256=sha256)
    except DataError as error:
        print(f"flowers: error: {error}", file=sys.stderr)
        return 2
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    print(f"The flower photos are in {root} ({len(classes)} classes: {', '.join(classes)}).")
    print(f"Train on them: flowers fit --config configs/tutorial.yaml --data.data_dir {root}")
    return 0
