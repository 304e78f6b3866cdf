"""LMDB under threads x processes with a watchdog: two processes each run two writer and two reader
threads putting 0.25-3 MiB values into a store far smaller than what they write (evictions in every
transaction, batches split, free pages scattered), while a third process keeps opening the store with
another capacity, writing, reading and closing it. The watchdog fails the test when no process makes
progress for STALL_SECONDS (after asking every child for its thread stacks): a lock-order deadlock or a
hang fails here instead of hanging `make test`. Every value read anywhere is checked byte for byte, and
a reopen afterwards checks every entry and the byte accounting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import subprocess_env
from kvoffload import open_store
from kvoffload.store.lmdb_store import entry_charge

SECONDS = 12  # each worker's run
STALL_SECONDS = 40  # no progress in any process this long: a stall
CAPACITY = 48 << 20
FINGERPRINT = "stress-layout"
BAD = ("checksum_failures", "bad_header", "length_mismatch", "version_mismatch", "fingerprint_mismatch",
       "read_errors", "damaged_files_reset")

WORKLOAD = r'''
import random

import numpy as np

PROCS, THREADS, KEYS = 3, 2, 400


def key_of(p, t, i):
    return b"stress/p%d/t%d/%05d" % (p, t, i)


def value_of(key):
    """The only bytes `key` may be served as (0.25-3 MiB), a function of the key alone."""
    r = random.Random(key)
    n = r.randint(1 << 18, 3 << 20)
    words = (n + 7) // 8
    body = np.resize(np.frombuffer(r.randbytes(4096), np.uint64), words)
    body ^= np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return body.tobytes()[:n]
'''

CHILD = WORKLOAD + r'''
import faulthandler, json, signal, sys, threading, time
from kvoffload import open_store

url, p, seconds, beat_path, result_path, fingerprint, reopen_url = sys.argv[1:8]
p, seconds = int(p), float(seconds)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks on a stall
deadline = time.monotonic() + seconds
ops, errors, acked, lock = [0], [], [], threading.Lock()


def check(key, value):
    if value is not None and value != value_of(key):
        errors.append(f"{key!r} served {len(value)} bytes that are not its value")


def writer(store, t):
    r = random.Random(p * 100 + t)
    i = 0
    while time.monotonic() < deadline and i < KEYS:
        batch = [key_of(p, t, j) for j in range(i, min(KEYS, i + r.choice((1, 1, 2, 4))))]
        ok = store.put_many([(k, value_of(k)) for k in batch])
        with lock:
            acked.extend(k.decode() for k, good in zip(batch, ok) if good)
            ops[0] += 1
        i += len(batch)


def reader(store, t):
    r = random.Random(p * 100 + 50 + t)
    out = bytearray(3 << 20)
    while time.monotonic() < deadline:
        keys = [key_of(r.randrange(PROCS), r.randrange(THREADS), r.randrange(KEYS // 8)) for _ in range(3)]
        if r.random() < 0.5:
            for k in keys:
                check(k, store.get(k))
        else:
            n = store.get_into(keys[0], out)
            check(keys[0], None if n is None else bytes(out[:n]))
        with lock:
            ops[0] += 1


def beat():
    while time.monotonic() < deadline + 60:
        with open(beat_path + ".tmp", "w") as f:
            f.write(str(ops[0]))
        os.replace(beat_path + ".tmp", beat_path)
        time.sleep(0.2)


import os
threading.Thread(target=beat, daemon=True).start()
stats = {}
if reopen_url != "-":  # open, write, read, close, again: with another capacity every other time
    r = random.Random(p)
    i = 0
    while time.monotonic() < deadline:
        with open_store(reopen_url if i % 2 else url, fingerprint=fingerprint) as s:
            k = key_of(p, 0, i % KEYS)
            if s.put(k, value_of(k)):
                acked.append(k.decode())
            check(k, s.get(k))
            other = key_of(0, 0, r.randrange(KEYS // 8))
            check(other, s.get(other))
            stats = s.stats()
        ops[0] += 1
        i += 1
else:
    store = open_store(url, fingerprint=fingerprint)
    threads = [threading.Thread(target=f, args=(store, t)) for f in (writer, reader) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = store.stats()
    store.close()
with open(result_path, "w") as f:
    json.dump({"errors": errors[:20], "acked": acked, "ops": ops[0],
               "stats": {k: v for k, v in stats.items() if isinstance(v, int)}}, f)
'''

ns: dict = {}
exec(compile(WORKLOAD, "<stress workload>", "exec"), ns)


def _watch(procs, beats, deadline: float) -> None:
    """Wait for every child; fail on a stall (no process made progress for STALL_SECONDS)."""
    last, progress_at = {}, time.monotonic()
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        for path in beats:
            try:
                with open(path) as f:
                    count = f.read()
            except (FileNotFoundError, ValueError):
                continue
            if last.get(path) != count:
                last[path], progress_at = count, now
        if now - progress_at > STALL_SECONDS or now > deadline:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)  # thread stacks to its stderr
            time.sleep(1)
            for p in procs:
                p.kill()
            stacks = "\n".join(p.communicate()[1].decode()[-3000:] for p in procs)
            pytest.fail(f"stall: no progress for {now - progress_at:.0f} s (ops {last}); stacks:\n{stacks}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_threads_and_processes_with_evictions_and_reopens_never_stall(tmp_path):
    url = f"lmdb://{tmp_path}/store?capacity={CAPACITY}"
    procs, beats, results = [], [], []
    try:
        for p in range(ns["PROCS"]):
            beats.append(str(tmp_path / f"beat{p}"))
            results.append(str(tmp_path / f"result{p}.json"))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", CHILD, url, str(p), str(SECONDS), beats[-1], results[-1], FINGERPRINT,
                 f"lmdb://{tmp_path}/store?capacity={CAPACITY // 2}" if p == ns["PROCS"] - 1 else "-"],
                env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        _watch(procs, beats, deadline=time.monotonic() + 200)
        failures = [f"process {i} exited {p.returncode}: {p.communicate()[1].decode()[-2000:]}"
                    for i, p in enumerate(procs) if p.returncode != 0]
        assert not failures, "\n".join(failures)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for path in results:
        with open(path) as f:
            reports.append(json.load(f))
    assert [r["errors"] for r in reports] == [[]] * len(reports)
    for r in reports:
        assert all(r["stats"].get(name, 0) == 0 for name in BAD), r["stats"]
    workers = reports[:-1]
    assert all(r["ops"] > 20 for r in reports), [r["ops"] for r in reports]
    assert sum(r["stats"]["evictions"] for r in workers) > 0  # far more was written than fits
    assert reports[-1]["ops"] >= 3  # the reopening process got in between, several times

    # Reopened alone: every entry is its key's value, the accounting is exactly what is there.
    with open_store(url, fingerprint=FINGERPRINT) as store:
        present = {}
        for r in reports:
            for k in set(r["acked"]):
                value = store.get(k.encode())
                if value is not None:
                    assert value == ns["value_of"](k.encode()), k
                    present[k] = len(value)
        stats = store.stats()
    assert present, "nothing acknowledged survived"
    assert stats["entries"] == len(present), stats
    assert stats["bytes_used"] == sum(entry_charge(n) for n in present.values()) <= CAPACITY
