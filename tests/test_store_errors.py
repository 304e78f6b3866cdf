"""Bad URLs, directories and options fail at open with a message that says what to change."""

import os
import stat

import lmdb
import pytest

from kvoffload import open_store
from kvoffload.store import IncompatibleStoreError, StoreConfigError, parse_size


@pytest.mark.parametrize("url, message", [
    ("not a url", "invalid store URL"),
    ("redis-like://host", "unknown store scheme"),
    ("memory://?capacity=4XB", "invalid memory capacity"),
    ("memory://?capacity=-5", "invalid memory capacity"),
    ("memory://?capacity=0", "must be positive"),
    ("memory://?capacity=1GiB&colour=blue", "unknown option"),
    ("memory:///some/path", "takes no path"),
    ("memory://?pinned=maybe", "invalid pinned"),
    ("lmdb://relative/dir", "must be absolute"),
    ("lmdb://", "needs an absolute directory"),
    ("tiered://?memory=1GiB", "needs lmdb="),
    ("memory://?capacity=1GiB&capacity=2GiB", "given twice"),
])
def test_bad_urls(url, message):
    with pytest.raises(StoreConfigError, match=message):
        open_store(url)


def test_sizes():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512") == 512
    assert parse_size("64 MiB") == 64 << 20


def test_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreConfigError, match="not a directory"):
        open_store(f"lmdb://{tmp_path}/file")


def test_directory_that_cannot_be_created():
    with pytest.raises(StoreConfigError, match="cannot create LMDB store directory"):
        open_store("lmdb:///proc/kvoffload-cannot-exist/store")


def test_unwritable_directory(tmp_path):
    # /proc/self is a directory nobody (not even root) can create files in.
    with pytest.raises(StoreConfigError, match="not writable|readable by others"):
        open_store("lmdb:///proc/self")


def test_store_directory_is_private(tmp_path):
    with open_store(f"lmdb://{tmp_path}/new/store"):
        pass
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "store").st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "store" / name).st_mode) & 0o077 == 0


def test_existing_open_directory_is_tightened(tmp_path):
    path = tmp_path / "shared"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    with open_store(f"lmdb://{path}"):
        pass
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_incompatible_format_version(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    with open_store(url) as store:
        store.put(b"k", b"v")
    env = lmdb.open(f"{tmp_path}/db", max_dbs=8)
    info = env.open_db(b"info")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", (99).to_bytes(8, "big"), db=info)
    env.close()
    with pytest.raises(IncompatibleStoreError, match="format version 99"):
        open_store(url)


def test_capacity_smaller_than_one_entry(tmp_path):
    from kvoffload.store import EntryTooLargeError

    with open_store(f"lmdb://{tmp_path}/db?capacity=1000") as store:
        with pytest.raises(EntryTooLargeError, match="cannot fit"):
            store.put(b"k", b"x" * 1000)  # + header bytes: over the cap
        assert store.put(b"k", b"x" * 900)
