"""A real Mooncake master for the Mooncake benchmark and tests: the `mooncake_master` binary of the
`mooncake-transfer-engine` wheel, with its own HTTP metadata server (no etcd), on 127.0.0.1 or another
address of this host (`host`). Every port is a free port chosen here; a master stopped and started
again keeps its ports (not its objects: Mooncake's master keeps its metadata in memory)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from urllib.parse import quote

from .s3_server import free_ports


def binary() -> str:
    """`mooncake_master` from the installed wheel (beside its Python package), else one on PATH."""
    try:
        import mooncake

        path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found: pip install 'kvoffload[mooncake]'")
    return found


class Master:
    """`client_ttl`: seconds after a client's last heartbeat before its segment is dropped."""

    def __init__(
        self, *, host: str = "127.0.0.1", client_ttl: int = 2, lease_ms: int = 500, ready_timeout: float = 30.0
    ):
        self.host = host
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.client_ttl, self.lease_ms, self.ready_timeout = client_ttl, lease_ms, ready_timeout
        self.process: subprocess.Popen | None = None

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def url(self, **options) -> str:
        """A mooncake:// URL of this master, with `options` (segment=, namespace=, ...)."""
        query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in {"metadata": self.metadata, **options}.items())
        return f"mooncake://{self.host}:{self.rpc_port}?{query}"

    def start(self) -> None:
        args = [
            binary(),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.http_port}",
            f"--http_metadata_server_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            f"--client_ttl={self.client_ttl}",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({self.process.returncode}) at start-up")
            try:
                for port in (self.rpc_port, self.http_port):
                    socket.create_connection((self.host, port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen within {self.ready_timeout} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def __enter__(self) -> Master:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
