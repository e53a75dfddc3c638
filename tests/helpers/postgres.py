"""A PostgreSQL server of a test's own on 127.0.0.1, in a temporary folder, for studies shared by machines.

Debian's ``postgresql`` package gives the programs (``make postgres`` installs it); the server runs as the
``postgres`` user where the tests run as root, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import free_port


def _program(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    return str(versions[-1]) if versions else None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """The URL of a fresh server that trusts local connections, stopped and removed afterwards."""
    initdb, pg_ctl = _program("initdb"), _program("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL's initdb and pg_ctl are not installed: `make postgres` installs Debian's postgresql")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="flowers-postgres-"))
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(folder)
            pytest.skip("PostgreSQL refuses to run as root, and there is no postgres user to run it as")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()
    try:
        subprocess.run([*as_user, initdb, "-D", str(data), "-U", "flowers", "--auth=trust", "--no-sync"],
                       check=True, capture_output=True, timeout=120)
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-o", options, "-l", str(folder / "server.log"), "-w",
                        "start"], check=True, capture_output=True, timeout=120)
        yield f"postgresql://flowers@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True,
                       timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
