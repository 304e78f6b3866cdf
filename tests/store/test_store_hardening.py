"""Regression tests for the store hardening: opens that race or meet unreadable and damaged files, puts
larger than the store, accounting that must not trust a damaged header, a full disk under many
readers, batches that evict their own entries, a pinned memory tier without a GPU, private directories.
(The lock-order deadlock has its own stress test: test_lmdb_stress.py.)"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile

import lmdb
import numpy as np
import pytest

from conftest import subprocess_env
from kvoffload import open_store
from kvoffload.errors import KVOffloadError
from kvoffload.store import EntryTooLargeError, KeyTooLongError, StoreConfigError
from kvoffload.store.lmdb_store import entry_charge

MiB = 1 << 20


def _value(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def _run(script: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120, **kwargs)


# -- 2. opening: races, unreadable files ------------------------------------------------------------

OPENER = r"""
import sys, time
from kvoffload import open_store
path, i = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()
with open_store(f"lmdb://{path}?capacity=8MiB") as store:
    assert store.put(b"k%d" % i, b"v%d" % i)
    print("acked", store.stats().get("damaged_files_reset", 0), flush=True)
    time.sleep(0.5)  # still open while the others open and write
"""


def test_processes_opening_a_new_store_at_once_lose_no_acknowledged_put(tmp_path):
    path = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, path, str(i)], env=subprocess_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(6)]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    assert [out.split() for out, _ in outs] == [["acked", "0"]] * 6
    assert not [n for n in os.listdir(path) if ".damaged-" in n]
    with open_store(f"lmdb://{path}?capacity=8MiB") as store:
        assert [store.get(b"k%d" % i) for i in range(6)] == [b"v%d" % i for i in range(6)]


def test_a_data_file_being_created_is_not_mistaken_for_damage(tmp_path):
    """The window another process's creation leaves (the file exists, its meta pages are not written
    yet), held open: an open must not move it aside, which would orphan the creator's writes."""
    path = tmp_path / "db"
    path.mkdir(mode=0o700)
    (path / "data.mdb").touch(mode=0o600)
    with open_store(f"lmdb://{path}?capacity=1MiB") as store:
        assert store.stats().get("damaged_files_reset", 0) == 0 and store.put(b"k", b"v")
    assert not [n for n in os.listdir(path) if ".damaged-" in n]


UNREADABLE = r"""
import os, sys
from kvoffload import open_store
from kvoffload.store import StoreConfigError
import lmdb._envid  # lmdb imports it lazily; the new user cannot read root's environment
os.setgid(65534); os.setuid(65534)  # an ordinary user: file modes apply (modules imported before)
path = sys.argv[1]
with open_store(f"lmdb://{path}?capacity=1MiB") as store:
    store.put(b"kept", b"value")
os.chmod(os.path.join(path, "data.mdb"), 0)
try:
    open_store(f"lmdb://{path}?capacity=1MiB")
except StoreConfigError as exc:
    print("error:", exc)
os.chmod(os.path.join(path, "data.mdb"), 0o600)
with open_store(f"lmdb://{path}?capacity=1MiB") as store:
    print("after:", store.get(b"kept"), sorted(os.listdir(path)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the check as another user")
def test_unreadable_data_file_is_a_clear_error_and_is_left_alone():
    base = tempfile.mkdtemp(prefix="kvoffload-perm-")
    try:
        os.chmod(base, 0o755)
        os.chown(base, 65534, 65534)
        out = _run(UNREADABLE, os.path.join(base, "store"), cwd=base)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "error: cannot read and write" in out.stdout and "permission denied" in out.stdout
        assert "after: b'value'" in out.stdout and "damaged" not in out.stdout
    finally:
        shutil.rmtree(base)


def _main_root_page(path: str) -> int:
    """The root page of LMDB's main database (where the named databases are recorded), from the
    newer of the two meta pages."""
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        pages = f.read(2 * 4096)
    metas = []
    for page in (pages[:4096], pages[4096:]):
        root, _, txnid = struct.unpack_from("<QQQ", page, 16 + 24 + 48 + 40)
        metas.append((txnid, root))
    return max(metas)[1]


def test_damaged_main_database_page_resets_the_store_instead_of_failing_to_open(tmp_path):
    path = str(tmp_path / "db")
    with open_store(f"lmdb://{path}?capacity=8MiB") as store:
        store.put_many([(b"k%d" % i, _value(i, 10_000)) for i in range(20)])
    root = _main_root_page(path)
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(root * 4096 + 8)
        f.write(b"\xff" * 8)  # the page header: flags, bounds
    with open_store(f"lmdb://{path}?capacity=8MiB") as store:
        assert store.stats()["damaged_files_reset"] == 1
        assert store.get(b"k1") is None
        assert store.put(b"new", b"works") and store.get(b"new") == b"works"
    assert [n for n in os.listdir(path) if n.startswith("data.mdb.damaged-")]


# -- 3. puts larger than the store ------------------------------------------------------------------

def test_a_value_over_a_quarter_of_the_capacity_is_refused_before_it_evicts_anything(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity=100MiB"
    held = {b"big%d" % i: _value(90 + i, 20 * MiB) for i in range(3)}  # 60 MiB
    held.update({b"s%d" % i: _value(i, 4096) for i in range(20)})  # and 20 small entries
    with open_store(url) as store:
        assert all(store.put_many(list(held.items())))
        with pytest.raises(EntryTooLargeError, match="up to"):
            store.put(b"huge", b"x" * (90 * MiB))
        assert all(store.get(k) == v for k, v in held.items())
        assert store.stats()["evictions"] == 0
    # Values up to the quarter always find room again, however the store was filled, also after reopening.
    for round_ in range(2):
        with open_store(url) as store:
            for i in range(12):
                size = 25 * MiB - 4096 if i % 3 == 0 else (i * 7919) % (9 * MiB) + 1
                assert store.put(b"r%d-%d" % (round_, i), _value(i, size)), (round_, i, store.stats())
            stats = store.stats()
            assert stats["dropped_puts"] == 0 and stats["bytes_used"] <= 100 * MiB


@pytest.mark.parametrize("tier", ["lmdb", "memory"])
def test_a_batch_larger_than_the_store_reports_its_own_evicted_entries(tmp_path, tier):
    url = {"lmdb": f"lmdb://{tmp_path}/db?capacity=8MiB", "memory": "memory://?capacity=8MiB"}[tier]
    items = [(b"b%03d" % i, _value(i, 512 << 10)) for i in range(40)]  # 20 MiB into 8 MiB
    with open_store(url) as store:
        assert store.put(b"before", b"x" * 100)
        ok = store.put_many(items)
        assert 0 < sum(ok) < len(items)
        assert ok[-1] and not ok[0]  # the newest stay, the oldest went
        for (key, value), good in zip(items, ok):
            assert (store.get(key) == value) if good else (store.get(key) is None), key
        assert store.stats()["bytes_used"] <= 8 * MiB
        # a key written twice in one batch: only its last value is held
        twice = store.put_many([(b"dup", b"one"), (b"dup", b"two")])
        assert twice == [False, True] and store.get(b"dup") == b"two"


def test_a_key_over_the_lmdb_limit_refuses_the_batch_in_every_tier(tmp_path):
    for url in (f"lmdb://{tmp_path}/db?capacity=1MiB", f"tiered://?memory=1MiB&lmdb={tmp_path}/t&lmdb_capacity=1MiB"):
        with open_store(url) as store:
            with pytest.raises(KeyTooLongError, match="600-byte key is longer"):  # a ValueError too
                store.put_many([(b"fine", b"1"), (b"k" * 600, b"2")])
            assert store.get(b"fine") is None and store.get(b"k" * 600) is None


def test_a_key_too_long_is_a_kvoffload_error_and_a_value_error():
    assert issubclass(KeyTooLongError, KVOffloadError) and issubclass(KeyTooLongError, ValueError)


def test_a_refused_store_directory_is_left_as_it_was_found(tmp_path):
    """A directory that cannot become a store (here: a symlinked data file) keeps its mode: no chmod
    before the refusal."""
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, 0o755)
    os.symlink(tmp_path / "elsewhere", path / "data.mdb")
    with pytest.raises(StoreConfigError, match="symlink"):
        open_store(f"lmdb://{path}?capacity=1MiB")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755


# -- 4. accounting from the stored records, not from a header ---------------------------------------

def _edit_meta(path: str, key: bytes, edit) -> None:
    env = lmdb.open(path, max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(key, edit(bytearray(txn.get(key, db=meta))), db=meta)
    env.close()


@pytest.mark.parametrize("evict", ["", "&evict=s3fifo"], ids=["lru", "s3fifo"])
@pytest.mark.parametrize("damage", ["magic", "length"])
def test_a_damaged_header_does_not_corrupt_the_byte_count(tmp_path, damage, evict):
    path, url = str(tmp_path / "db"), f"lmdb://{tmp_path}/db?capacity=1MiB{evict}"
    with open_store(url) as store:
        assert store.put_many([(b"k%d" % i, _value(i, 200 << 10)) for i in range(4)]) == [True] * 4

    def edit(raw):
        if damage == "magic":
            raw[0] ^= 0xFF
        else:
            raw[24:32] = (1 << 62).to_bytes(8, "little")
        return bytes(raw)

    _edit_meta(path, b"k1", edit)
    with open_store(url) as store:
        assert store.put(b"k1", _value(9, 200 << 10))  # overwriting the damaged entry works
        assert store.get(b"k1") == _value(9, 200 << 10)
    _edit_meta(path, b"k2", edit)
    with open_store(url) as store:
        assert store.get(b"k2") is None  # a counted miss, and the entry is gone
        stats = store.stats()
        assert stats["entries"] == 3 and stats["bytes_used"] == 3 * entry_charge(200 << 10)
        assert store.put(b"k5", _value(5, 200 << 10))
        assert store.stats()["evictions"] == 0 and store.stats()["bytes_used"] <= 1 * MiB


@pytest.mark.parametrize("evict", ["", "&evict=s3fifo"], ids=["lru", "s3fifo"])
@pytest.mark.parametrize("record, raw", [(b"bytes_used", b"\x01\x02\x03"), (b"tick", b"garbage!!"),
                                         (b"bytes_used", (1 << 63).to_bytes(8, "big")[:7])])
def test_damaged_counter_records_are_rebuilt(tmp_path, record, raw, evict):
    path, url = str(tmp_path / "db"), f"lmdb://{tmp_path}/db?capacity=1MiB{evict}"
    with open_store(url) as store:
        store.put_many([(b"k%d" % i, _value(i, 50_000)) for i in range(3)])
    env = lmdb.open(path, max_dbs=8)
    info = env.open_db(b"info")
    with env.begin(write=True) as txn:
        txn.put(record, raw, db=info)
    env.close()
    with open_store(url) as store:
        assert store.stats()["bytes_used"] == 3 * entry_charge(50_000)
        assert store.put(b"k3", _value(3, 50_000)) and store.get(b"k0") == _value(0, 50_000)
        assert store.stats()["bytes_used"] == 4 * entry_charge(50_000)


def test_a_damaged_format_record_resets_the_store(tmp_path):
    path, url = str(tmp_path / "db"), f"lmdb://{tmp_path}/db?capacity=1MiB"
    with open_store(url) as store:
        store.put(b"k", b"v")
    env = lmdb.open(path, max_dbs=8)
    info = env.open_db(b"info")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"\x00\x01", db=info)
    env.close()
    with open_store(url) as store:
        assert store.stats()["damaged_files_reset"] == 1 and store.get(b"k") is None
        assert store.put(b"k", b"again") and store.get(b"k") == b"again"


# -- 5. a full disk under many readers ----------------------------------------------------------------

READERS = r"""
import sys, threading
from kvoffload import open_store
store = open_store(f"lmdb://{sys.argv[1]}?capacity=8MiB")
barrier = threading.Barrier(100)
hits = []
def read():
    barrier.wait()
    for _ in range(20):
        hits.append(store.get(b"k1") is not None)
threads = [threading.Thread(target=read) for _ in range(100)]
for t in threads: t.start()
for t in threads: t.join()
assert store.put(b"after", b"x" * 100_000)  # its own space is reserved: writes go on
print(sum(hits), len(hits), store.get(b"after") is not None)
"""


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs("24m")


def test_many_readers_on_a_full_disk_do_not_crash(small_disk):
    path = str(small_disk / "store")
    with open_store(f"lmdb://{path}?capacity=8MiB") as store:
        store.put_many([(b"k%d" % i, _value(i, 100_000)) for i in range(5)])
    with open(small_disk / "filler", "wb") as f:  # fill the disk to the last block
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    out = _run(READERS, path)
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS): {out.stderr[-2000:]}"
    assert out.stdout.split() == ["2000", "2000", "True"]


# -- 7. a pinned memory tier without a GPU ------------------------------------------------------------

def test_pinned_memory_without_a_gpu_is_refused_at_open(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    with pytest.raises(StoreConfigError, match="pinned=true needs"):
        open_store("memory://?capacity=1MiB&pinned=true")
    with pytest.raises(StoreConfigError, match="pinned=true needs"):
        open_store(f"tiered://?memory=1MiB&pinned=true&lmdb={tmp_path}/t&lmdb_capacity=1MiB")
    assert not os.path.exists(tmp_path / "t")  # refused before anything was created or written


# -- 12. directories and files stay private ------------------------------------------------------------

def test_intermediate_directories_are_private_under_any_umask(tmp_path):
    old = os.umask(0)
    try:
        with open_store(f"lmdb://{tmp_path}/a/b/store?capacity=1MiB"):
            pass
    finally:
        os.umask(old)
    for d in ("a", "a/b", "a/b/store"):
        assert stat.S_IMODE(os.stat(tmp_path / d).st_mode) == 0o700, d


def test_existing_open_data_files_are_tightened(tmp_path):
    path = tmp_path / "db"
    with open_store(f"lmdb://{path}?capacity=1MiB") as store:
        store.put(b"k", b"v")
    os.chmod(path / "data.mdb", 0o644)
    os.chmod(path / "lock.mdb", 0o666)
    with open_store(f"lmdb://{path}?capacity=1MiB") as store:
        assert store.get(b"k") == b"v"
    assert stat.S_IMODE(os.stat(path / "data.mdb").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path / "lock.mdb").st_mode) == 0o600


def test_a_data_file_symlink_is_refused(tmp_path):
    path = tmp_path / "db"
    path.mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "data.mdb"
    os.symlink(target, path / "data.mdb")  # dangling: LMDB would create its target outside the store
    with pytest.raises(StoreConfigError, match="is a symlink or not a regular file"):
        open_store(f"lmdb://{path}?capacity=1MiB")
    assert not target.exists()
