"""Several processes on one LMDB directory at once: each writes its own keys and keeps reading its
own and the others' (with a small capacity, while they evict each other's entries); processes that
open the store with other capacities meanwhile never resize the file under it. Every value is a
deterministic function of its key, so every read is checked."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from kvoffload import open_store
from kvoffload.store.lmdb_store import entry_charge, map_size_for

from conftest import ROOT  # noqa: E402  (the repository root)
WORKERS = 4
FINGERPRINT = "concurrency-test-layout"
BAD_COUNTERS = ("checksum_failures", "bad_header", "length_mismatch", "version_mismatch",
                "fingerprint_mismatch", "read_errors", "damaged_files_reset")

# Shared by the parent (exec'd below) and the workers (run with `python -c`).
WORKLOAD = r'''
import random

import numpy as np

MAX_VALUE = 1 << 20


def key_of(w, i):
    return b"conc/w%d/%05d" % (w, i)


def value_of(w, i):
    """The only bytes key (w, i) may be served as: 1 B .. 1 MiB, a random 4 KiB block for the key
    repeated with each 8-byte word mixed with its index (no other key, offset or blank page matches)."""
    r = random.Random((w << 32) | i)
    c = r.random()
    if c < 0.10:
        n = r.randint(1, 40)
    elif c < 0.30:
        n = r.randint(41, 64 << 10)
    else:
        n = r.randint(64 << 10, MAX_VALUE)
    words = (n + 7) // 8
    body = np.resize(np.frombuffer(r.randbytes(4096), np.uint64), words)
    body ^= np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return body.tobytes()[:n]
'''

WORKER = WORKLOAD + r'''
import json, sys
from kvoffload import open_store

url, w, workers, nkeys, seed, evicting, result_path, fingerprint = sys.argv[1:9]
w, workers, nkeys, seed, evicting = int(w), int(workers), int(nkeys), int(seed), evicting == "1"
rng = random.Random(seed * 100 + w)
store = open_store(url, fingerprint=fingerprint)
out = bytearray(MAX_VALUE)
res = {"written": [], "dropped": [], "own_hits": 0, "own_misses": 0, "cross_hits": 0, "cross_misses": 0,
       "errors": [], "max_bytes_used": 0, "map_sizes": set()}
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"


def check(kw, ki, value, own):
    kind = "own" if own else "cross"
    if value is None:
        res[kind + "_misses"] += 1
        if own and not evicting:
            res["errors"].append(f"own key {ki}, written earlier, is missing")
        return
    if value != value_of(kw, ki):
        res["errors"].append(f"key ({kw}, {ki}) served {len(value)} bytes that are not its value")
    else:
        res[kind + "_hits"] += 1


def read(keys, own):
    style = rng.randrange(3)
    if style == 0:
        for kw, ki in keys:
            check(kw, ki, store.get(key_of(kw, ki)), own)
    elif style == 1:
        for kw, ki in keys:
            n = store.get_into(key_of(kw, ki), out)
            check(kw, ki, None if n is None else bytes(out[:n]), own)
    else:
        outs = [bytearray(MAX_VALUE) for _ in keys]
        sizes = store.get_many([key_of(kw, ki) for kw, ki in keys], outs)
        for (kw, ki), n, o in zip(keys, sizes, outs):
            check(kw, ki, None if n is None else bytes(o[:n]), own)


i = 0
while i < nkeys:
    batch = list(range(i, min(nkeys, i + (1 if rng.random() < 0.5 else rng.randint(2, 4)))))
    i = batch[-1] + 1
    items = [(key_of(w, j), value_of(w, j)) for j in batch]
    ok = [store.put(*items[0])] if len(items) == 1 else store.put_many(items)
    for j, good in zip(batch, ok):
        res["written" if good else "dropped"].append(j)
    stats = store.stats()
    res["max_bytes_used"] = max(res["max_bytes_used"], stats["bytes_used"])
    res["map_sizes"].add(stats["map_size"])
    if res["written"]:
        read([(w, rng.choice(res["written"])) for _ in range(2)], own=True)
    others = [o for o in range(workers) if o != w]
    read([(rng.choice(others), rng.randrange(nkeys)) for _ in range(3)], own=False)

# a last pass over everything everyone may have written by now
read([(o, j) for o in range(workers) if o != w for j in range(nkeys)], own=False)
stats = store.stats()
res["stats"] = {k: v for k, v in stats.items() if isinstance(v, int)}
res["map_sizes"] = sorted(res["map_sizes"])
store.close()
with open(result_path, "w") as f:
    json.dump(res, f)
'''

ns: dict = {}
exec(compile(WORKLOAD, "<concurrency workload>", "exec"), ns)
key_of, value_of = ns["key_of"], ns["value_of"]


def run_workers(tmp_path, url: str, nkeys: int, seed: int, evicting: bool) -> list[dict]:
    """Start WORKERS processes, release them together, wait; every one must exit 0 with no errors."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    procs, paths = [], []
    try:
        for w in range(WORKERS):
            path = str(tmp_path / f"worker{w}.json")
            paths.append(path)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", WORKER, url, str(w), str(WORKERS), str(nkeys), str(seed),
                 "1" if evicting else "0", path, FINGERPRINT],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT))
        for w, p in enumerate(procs):
            ready, _, _ = select.select([p.stdout], [], [], 60)
            line = p.stdout.readline() if ready else b""
            assert line.strip() == b"ready", f"worker {w} did not start: {line!r}"
        for p in procs:  # all open: let them go at once
            p.stdin.write(b"go\n")
            p.stdin.flush()
        failures = []
        for w, p in enumerate(procs):
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                failures.append(f"worker {w} exited with {p.returncode}:\n{err.decode()[-2000:]}")
        assert not failures, "\n".join(failures)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for w, path in enumerate(paths):
        with open(path) as f:
            res = json.load(f)
        assert not res["errors"], f"worker {w}: {res['errors'][:5]}"
        for name in BAD_COUNTERS:
            assert res["stats"].get(name, 0) == 0, (w, name, res["stats"])
        results.append(res)
    return results


def check_fresh_open(url: str, nkeys: int) -> tuple[dict, dict]:
    """Reopen and read every key any worker could have written: each present one must be exact and
    the store's entry count and byte accounting must match what is actually there."""
    present: dict[tuple[int, int], int] = {}
    with open_store(url, fingerprint=FINGERPRINT) as store:
        for w in range(WORKERS):
            for i in range(nkeys):
                value = store.get(key_of(w, i))
                if value is not None:
                    assert value == value_of(w, i), f"key ({w}, {i}) is not its value after reopening"
                    present[(w, i)] = len(value)
        stats = store.stats()
    for name in BAD_COUNTERS:
        assert stats.get(name, 0) == 0, (name, stats)
    assert stats["entries"] == len(present), stats
    assert stats["bytes_used"] == sum(entry_charge(n) for n in present.values()), stats
    return present, stats


@pytest.mark.timeout(600)
def test_four_processes_below_the_capacity(tmp_path):
    capacity, nkeys = 256 << 20, 110  # ~180 MiB in all: under the capacity, so nothing is evicted
    url = f"lmdb://{tmp_path}/store?capacity=256MiB"
    results = run_workers(tmp_path, url, nkeys, seed=7, evicting=False)

    assert sum(r["own_hits"] for r in results) > WORKERS * nkeys // 2
    assert sum(r["cross_hits"] for r in results) > WORKERS * nkeys // 2
    for w, r in enumerate(results):
        assert r["dropped"] == [], f"worker {w} had puts refused below the capacity: {r['dropped']}"
        assert r["stats"]["evictions"] == 0, r["stats"]

    present, stats = check_fresh_open(url, nkeys)
    written = {(w, i) for w, r in enumerate(results) for i in r["written"]}
    assert set(present) == written
    assert stats["bytes_used"] <= capacity
    # The map is sized once, at open: no process ever saw it change.
    assert {m for r in results for m in r["map_sizes"]} == {map_size_for(capacity)}, [r["map_sizes"] for r in results]


@pytest.mark.parametrize("evict", ["", "&evict=s3fifo"], ids=["lru", "s3fifo"])
def test_four_processes_evicting_each_other(tmp_path, evict):
    capacity, nkeys = 8 << 20, 40  # ~60 MiB written into 8 MiB
    url = f"lmdb://{tmp_path}/store?capacity=8MiB{evict}"
    results = run_workers(tmp_path, url, nkeys, seed=11, evicting=True)

    for w, r in enumerate(results):
        assert r["max_bytes_used"] <= capacity, (w, r["max_bytes_used"])
        assert r["stats"]["bytes_used"] <= capacity, (w, r["stats"])
    assert sum(r["stats"]["evictions"] for r in results) > 0
    assert sum(r["own_hits"] + r["cross_hits"] for r in results) > 0

    present, stats = check_fresh_open(url, nkeys)
    assert 0 < stats["bytes_used"] <= capacity, stats
    assert not evict or 0 <= stats["small_bytes"] <= stats["bytes_used"], stats
    assert len(present) < WORKERS * nkeys  # eviction really removed entries
    written = {(w, i) for w, r in enumerate(results) for i in r["written"]}
    assert set(present) <= written, "a key whose put returned False is being served"


# -- a process that opens the store with another capacity while it is in use ----------------------------

HOLDER = r"""
import sys
from kvoffload import open_store
store = open_store(f"lmdb://{sys.argv[1]}?capacity=64MiB")
for i in range(40):
    assert store.put(b"k%d" % i, (b"%08d" % i) * (1 << 15))
print("holding", flush=True)
sys.stdin.readline()
for i in range(40, 80):                                    # the file was not cut or grown under us
    assert store.put(b"k%d" % i, (b"%08d" % i) * (1 << 15))
assert all(store.get(b"k%d" % i) == (b"%08d" % i) * (1 << 15) for i in range(80))
store.close()
print("done", flush=True)
"""


@pytest.mark.parametrize("other", ["16MiB", "256MiB"])
def test_other_capacity_adopts_the_open_map_and_applies_when_alone(tmp_path, other, caplog):
    store_dir = str(tmp_path / "store")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, store_dir], env=env, cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        data = os.path.join(store_dir, "data.mdb")
        size = os.path.getsize(data)
        with open_store(f"lmdb://{store_dir}?capacity={other}") as store:  # in use: adopts the file's map
            warned = [r.getMessage() for r in caplog.records if "another process opened it" in r.getMessage()]
            assert warned and "capacity 67108864 bytes" in warned[0], caplog.text  # each evicts to its own
            assert os.path.getsize(data) == size == store.stats()["map_size"]
            assert store.capacity == min(64 << 20, store.configured_capacity)
            assert store.get(b"k0") == b"%08d" % 0 * (1 << 15)
            assert store.put(b"other", b"x" * 1000)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=120)
        assert holder.returncode == 0 and out.strip() == "done", err[-2000:]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    with open_store(f"lmdb://{store_dir}?capacity={other}") as store:  # alone: the new capacity applies
        grown = map_size_for(store.configured_capacity)
        assert store.stats()["map_size"] == max(size, grown) == os.path.getsize(data)
        assert store.get(b"k79") == b"%08d" % 79 * (1 << 15)
