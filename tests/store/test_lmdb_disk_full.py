"""A full disk degrades the LMDB tier to fewer hits: no crash (no SIGBUS in a sparse map), no wrong bytes."""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import subprocess_env
from kvoffload import open_store

WRITER = r"""
import json, sys
import numpy as np
from kvoffload import open_store

path, count = sys.argv[1], int(sys.argv[2])
value = lambda i: np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8)
with open_store(f"lmdb://{path}?capacity=1GiB") as store:
    acked = [i for i in range(count) if store.put(b"k%d" % i, value(i))]
    served = exact = 0
    for i in range(count):
        got = store.get(b"k%d" % i)
        if got is not None:
            served += 1
            exact += got == value(i).tobytes()
    stats = store.stats()
with open_store(f"lmdb://{path}?capacity=1GiB") as store:  # reopens on the full disk
    reopened = sum(store.get(b"k%d" % i) == value(i).tobytes() for i in acked[-3:])
print(json.dumps({"acked": len(acked), "last_acked": acked[-1] if acked else None, "served": served,
                  "exact": exact, "reopened": reopened, "stats": stats}))
"""


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs("40m")


def test_real_full_disk_means_fewer_hits_not_a_crash(small_disk):
    out = subprocess.run([sys.executable, "-c", WRITER, str(small_disk / "store"), "120"], env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"writer died (signal {-out.returncode if out.returncode < 0 else 0}): {out.stderr[-2000:]}"
    report = json.loads(out.stdout)
    assert report["exact"] == report["served"] > 0  # what is served is exact
    assert report["served"] < 120  # 120 MiB cannot fit on a 40 MiB disk
    assert report["last_acked"] == 119  # new pages still go in: older ones were evicted for them
    assert report["stats"]["disk_full"] >= 1 and report["stats"]["evictions"] > 0
    assert report["reopened"] == 3


def test_failed_allocation_evicts_instead_of_growing(tmp_path, monkeypatch):
    """Same contract without a mount: the filesystem refuses to back the map beyond 24 MiB."""
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        if offset + length > (24 << 20):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    value = lambda i: np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # noqa: E731
    with open_store(f"lmdb://{tmp_path}/db?capacity=1GiB") as store:
        results = [store.put(b"k%d" % i, value(i)) for i in range(60)]
        assert results[-1] is True
        served = {i: store.get(b"k%d" % i) for i in range(60)}
        stats = store.stats()
    hits = {i: v for i, v in served.items() if v is not None}
    assert 0 < len(hits) < 60
    assert all(v == value(i) for i, v in hits.items())
    assert stats["disk_full"] >= 1 and stats["evictions"] > 0
    assert stats["map_size"] <= 24 << 20
