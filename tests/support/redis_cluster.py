"""Test support: a Redis Cluster of real `redis-server` primaries on 127.0.0.1 (kvoffload.tools.bench.redis_server
starts each one)."""

from __future__ import annotations

import subprocess
import time

from kvoffload.tools.bench.redis_server import Server, binary

CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                "--cluster-require-full-coverage", "no")


def start_cluster(directory: str, nodes: int = 3) -> list[Server]:
    """`nodes` primaries joined by `redis-cli --cluster create`, once every node reports the cluster up."""
    servers = [Server(directory, extra=CLUSTER_ARGS) for _ in range(nodes)]
    try:
        subprocess.run([binary("redis-cli"), "--cluster", "create", *(s.address for s in servers), "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # every node must agree the cluster is up
            states = [subprocess.run([binary("redis-cli"), "-p", str(s.port), "cluster", "info"], capture_output=True,
                                     text=True).stdout for s in servers]
            if all("cluster_state:ok" in st for st in states):
                return servers
            time.sleep(0.2)
        raise RuntimeError("the Redis cluster did not come up")
    except Exception:
        for s in servers:
            s.stop()
        raise
