"""Fixtures for the auth and store tests: a throwaway PostgreSQL server, store URLs for both backends,
and small real HTTP servers built from ``server.auth`` + ``server.store_routes`` (no model needed).

Import the fixtures into a test module with ``from tests.server.store_fixtures import *``-style
explicit imports; pytest then finds them there.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, Request, Response, post

from server.auth import AuthMiddleware, Authenticator
from server.errors import EXCEPTION_HANDLERS
from server.store import Store
from server.store_routes import STORE_ROUTE_HANDLERS
from tests.conftest import free_port, serve_app

PG_USER = "trellis"
_PG_TOOLS = ("initdb", "pg_ctl", "createdb")


# --------------------------------------------------------------------------- PostgreSQL


def _major_version(bin_dir: str) -> int:
    name = Path(bin_dir).parent.name
    return int(name) if name.isdigit() else 0


def postgres_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/*/bin`` with initdb and pg_ctl (Debian), else ``pg_config --bindir``."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major_version, reverse=True)
    if shutil.which("pg_config"):
        bindir = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
        candidates.append(bindir)
    for directory in candidates:
        if all(Path(directory, tool).is_file() for tool in _PG_TOOLS):
            return Path(directory)
    return None


@dataclass
class PostgresServer:
    """A private PostgreSQL on 127.0.0.1:<port> (trust auth, fsync off) with a role ``trellis``, its
    cluster in ``root``; it can be stopped and started again on the same data and port."""

    bin_dir: Path
    root: Path
    port: int
    _counter: int = 0

    def create_database(self) -> str:
        """A fresh empty database; returns its ``postgresql://`` URL."""
        self._counter += 1
        name = f"trellis_test_{os.getpid()}_{self._counter}"
        subprocess.run([str(self.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, name],
                       check=True, capture_output=True, timeout=60)
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{name}"

    def start(self) -> None:
        """Start the server (again) on its data directory and port; returns once it accepts connections."""
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c full_page_writes=off"
        _run([str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), "-l", str(self.root / "server.log"),
              "-w", "-t", "60", "-o", options, "start"], "pg_ctl start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends every session (open transactions roll back), ``immediate`` kills it."""
        _run([str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), "-m", mode, "-w", "-t", "60", "stop"],
             "pg_ctl stop")


def _as_postgres_user(command: list[str]) -> list[str]:
    """initdb and the server refuse to run as root: run them as the ``postgres`` system user then."""
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(_as_postgres_user(command), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A new PostgreSQL cluster in a temporary directory, started; removed afterwards. Skips the test
    only where the server binaries are missing."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    root = Path(tempfile.mkdtemp(prefix="trellis-pg-"))
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail("running as root needs the 'postgres' system user to start PostgreSQL (installed with it)")
        os.chown(root, account.pw_uid, account.pw_gid)
    _run([str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync"],
         "initdb")
    server = PostgresServer(bin_dir, root, free_port())
    server.start()
    try:
        yield server
    finally:
        subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "-w",
                                          "stop"]), capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server shared by the session's tests (never stopped by them)."""
    with running_postgres() as server:
        yield server


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, which it may stop and start again."""
    with running_postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """A fresh database of each backend: a SQLite file, then a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite3")
    return request.getfixturevalue("postgres_server").create_database()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(store_url) -> AsyncIterator[Store]:
    """An open store on a fresh database (both backends)."""
    opened = await Store.open(store_url)
    try:
        yield opened
    finally:
        await opened.close()


# --------------------------------------------------------------------------- HTTP


@post("/v1/chat/completions", status_code=200)
async def fake_create(request: Request) -> Response:
    """Stands in for the app's generation route: the store's GET must coexist with this POST."""
    return Response(content=b'{"object":"chat.completion"}', media_type="application/json")


def build_app(authenticator: Authenticator, store_url: str | None = None, extra: Sequence[Any] = ()) -> Litestar:
    """A Litestar app with the auth middleware, the store routes, ``extra`` handlers and (when given) a store."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.store = await Store.open(store_url) if store_url else None
        try:
            yield
        finally:
            if app.state.store is not None:
                await app.state.store.close()

    return Litestar(
        route_handlers=[fake_create, *STORE_ROUTE_HANDLERS, *extra],
        lifespan=[lifespan],
        middleware=[AuthMiddleware(authenticator)],
        exception_handlers=EXCEPTION_HANDLERS,
        debug=False,
    )


def serve(app: Litestar) -> tuple[str, Callable[[], None]]:
    """Run ``app`` with uvicorn on a free loopback port in a thread; returns its base URL and a stop."""
    return serve_app(app)
