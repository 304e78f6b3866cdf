"""Crash safety of the LMDB tier: a writer SIGKILLed at random moments (many of them mid-commit) never
loses an acknowledged write, never rolls a key back past its last acknowledged version, and never
serves a half-written value. One store directory takes all the kills, so damage would accumulate.

The child's whole history is a deterministic function of (round, seed), so the parent can replay it:
after a kill, the acknowledged batches are a prefix of the replayed sequence and the one batch after
that prefix is the only one that may have committed without being acknowledged.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from kvoffload import open_store
from kvoffload.store import parse_size
from kvoffload.store.lmdb_store import entry_charge, map_size_for

from conftest import ROOT  # noqa: E402  (the repository root)
ROUNDS = 50
SEED = 20240611
CAPACITY = "512MiB"  # far above the live data (<= KEYS * 2 MiB): nothing is ever evicted
FINGERPRINT = "crash-test-layout"

# Shared by the parent (exec'd below) and the child (run with `python -c`): keys, values, schedule.
WORKLOAD = r'''
import random, struct

import numpy as np

KEYS = 160
PREFIX = struct.Struct("<IQ")  # key id, version: values of 12+ bytes say what they are


def key_of(k):
    return b"crash/%04d" % k


def value_of(k, v):
    """The only bytes (key k, version v) may ever be served as; 1 B .. 2 MiB. After the (k, v)
    prefix: a random 4 KiB block for (k, v), repeated, each 8-byte word mixed with its index, so bytes
    of another version, another key, another offset or a never-written page cannot pass for it."""
    r = random.Random((k << 40) | v)
    c = r.random()
    if c < 0.12:
        n = r.randint(1, 40)
    elif c < 0.35:
        n = r.randint(41, 16 << 10)
    elif c < 0.70:
        n = r.randint(16 << 10, 512 << 10)
    else:
        n = r.randint(512 << 10, 2 << 20)
    words = (n + 7) // 8
    body = np.resize(np.frombuffer(r.randbytes(4096), np.uint64), words)
    body ^= np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (PREFIX.pack(k, v) + body.tobytes())[:n]


def round_batches(rnd, seed):
    """Round `rnd`'s endless write schedule: batches of distinct (key, version); versions grow
    across rounds, so a larger version is always a later write."""
    r = random.Random(seed * 1000 + rnd)
    version = (rnd + 1) * 10_000_000
    while True:
        n = 1 if r.random() < 0.55 else r.randint(2, 6)
        keys = r.sample(range(KEYS), n)
        batch = []
        for k in keys:
            version += 1
            batch.append((k, version))
        yield batch
'''

CHILD = WORKLOAD + r'''
import os, sys
from kvoffload import open_store

url, ack_path, status_path, rnd, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
store = open_store(url, fingerprint=sys.argv[6])
status = os.open(status_path, os.O_RDWR)
acks = open(ack_path, "a")
print("ready", flush=True)
for i, batch in enumerate(round_batches(rnd, seed)):
    os.pwrite(status, b"G", 0)  # generating values
    items = [(key_of(k), value_of(k, v)) for k, v in batch]
    if i % 3 == 1:
        items = [(key, bytearray(val)) for key, val in items]
    os.pwrite(status, b"P", 0)  # inside put / put_many
    if len(items) == 1:
        ok = [store.put(*items[0])]
    else:
        ok = store.put_many(items)
    if not all(ok):
        sys.stderr.write(f"put returned {ok} for batch {i} {batch}: {store.stats()}\n")
        sys.exit(3)
    os.pwrite(status, b"A", 0)  # acknowledging (the put has returned True)
    acks.write("%d %d %s\n" % (rnd, i, ",".join("%d:%d" % kv for kv in batch)))
    acks.flush()
    os.fsync(acks.fileno())
'''

ns: dict = {}
exec(compile(WORKLOAD, "<crash workload>", "exec"), ns)
KEYS, PREFIX, key_of, value_of, round_batches = (ns[n] for n in ("KEYS", "PREFIX", "key_of", "value_of", "round_batches"))

BAD_COUNTERS = ("checksum_failures", "bad_header", "length_mismatch", "version_mismatch",
                "fingerprint_mismatch", "read_errors", "damaged_files_reset", "evictions", "dropped_puts")


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def kill_delay(rng: random.Random) -> float:
    """Seconds between the child's 'ready' and the SIGKILL: a few right at the start (first commits,
    first map growth), the rest spread over the write loop."""
    c = rng.random()
    if c < 0.15:
        return rng.uniform(0.0, 0.01)
    if c < 0.65:
        return rng.uniform(0.01, 0.3)
    return rng.uniform(0.3, 0.9)


def wait_for_phase(status_fd: int, phase: bytes, timeout: float) -> None:
    """Spin (briefly) until the child says it is inside a put: aims the kill at a commit."""
    deadline = time.monotonic() + timeout
    while os.pread(status_fd, 1, 0) != phase and time.monotonic() < deadline:
        time.sleep(0.0002)


def read_acks(ack_path: str, rnd: int) -> list[list[tuple[int, int]]]:
    """This round's acknowledged batches in order (complete lines only)."""
    out = []
    with open(ack_path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a line cut by the kill: its put had returned, but we need not count it
            r, i, kvs = line.split()
            if int(r) != rnd:
                continue
            assert int(i) == len(out), f"round {rnd}: acks out of order: {line!r}"
            out.append([tuple(map(int, kv.split(":"))) for kv in kvs.split(",")])
    return out


def identify(k: int, value: bytes, candidates: set[int]) -> int | None:
    """The version v with value == value_of(k, v), or None if the bytes are no whole version."""
    if len(value) >= PREFIX.size:
        kid, v = PREFIX.unpack_from(value)
        return v if kid == k and value == value_of(k, v) else None
    for v in candidates:
        if value == value_of(k, v):
            return v
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_writer_never_loses_acked_or_serves_torn_values(tmp_path):
    store_dir = tmp_path / "store"
    url = f"lmdb://{store_dir}?capacity={CAPACITY}"
    ack_path = str(tmp_path / "acks.log")
    status_path = str(tmp_path / "status")
    with open(status_path, "wb") as f:
        f.write(b"-")
    open(ack_path, "w").close()
    status_fd = os.open(status_path, os.O_RDONLY)
    rng = random.Random(SEED)
    env = child_env()

    floor: dict[int, int] = {}  # key -> version the store must serve from now on (acked or observed)
    kill_phase: Counter[str] = Counter()
    unacked_committed = 0
    acked_total = 0
    child = None
    try:
        for rnd in range(ROUNDS):
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, url, ack_path, status_path, str(rnd), str(SEED), FINGERPRINT],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
            ready, _, _ = select.select([child.stdout], [], [], 60)
            line = child.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                child.kill()
                _, err = child.communicate()
                pytest.fail(f"round {rnd}: child did not start: {line!r} {err.decode()[-3000:]}")
            delay, aimed, extra = kill_delay(rng), rng.random() < 0.6, rng.uniform(0.0, 0.004)
            time.sleep(delay)
            if aimed:
                wait_for_phase(status_fd, b"P", timeout=1.0)
                time.sleep(extra)
            if child.poll() is not None:
                _, err = child.communicate()
                pytest.fail(f"round {rnd}: child exited on its own (rc {child.returncode}): {err.decode()[-3000:]}")
            kill_phase[os.pread(status_fd, 1, 0).decode()] += 1
            child.send_signal(signal.SIGKILL)
            child.communicate()
            assert child.returncode == -signal.SIGKILL
            child = None

            # What the child acknowledged this round, and the one batch that may be committed unacked.
            acked = read_acks(ack_path, rnd)
            schedule = round_batches(rnd, SEED)
            replay = [next(schedule) for _ in range(len(acked) + 1)]
            assert acked == replay[: len(acked)], f"round {rnd}: ack log diverges from the schedule"
            acked_total += len(acked)
            for batch in acked:
                for k, v in batch:
                    floor[k] = v
            in_flight = dict(replay[-1])

            store = open_store(url, fingerprint=FINGERPRINT)
            try:
                present, used = 0, 0
                for k in range(KEYS):
                    legal = {floor[k]} if k in floor else set()
                    if k in in_flight:
                        legal.add(in_flight[k])
                    value = store.get(key_of(k))
                    assert store.contains(key_of(k)) == (value is not None), f"round {rnd}: key {k}"
                    if value is None:
                        assert k not in floor, (
                            f"round {rnd}: key {k} acknowledged at version {floor[k]} is missing")
                        continue
                    v = identify(k, value, legal)
                    assert v is not None, (
                        f"round {rnd}: key {k} served {len(value)} bytes that are no whole version of it")
                    assert v in legal, (
                        f"round {rnd}: key {k} served version {v}; legal: {sorted(legal)} "
                        f"(last acknowledged {floor.get(k)}, in flight {in_flight.get(k)})")
                    if v != floor.get(k):
                        unacked_committed += 1
                    floor[k] = v  # committed: it must never go back to an older one
                    present += 1
                    used += entry_charge(len(value))
                stats = store.stats()
                assert stats["entries"] == present, (rnd, stats)
                for name in BAD_COUNTERS:
                    assert stats.get(name, 0) == 0, (rnd, name, stats)
                # the capacity accounting survives the kills: each entry's pages and index records
                assert stats["bytes_used"] == used, (rnd, used, present, stats)
            finally:
                store.close()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.communicate()
        os.close(status_fd)

    # The run exercised what it claims to: many kills inside a put, acked data; the file never grew.
    print(f"kill phases {dict(kill_phase)}, acked batches {acked_total}, "
          f"unacked-but-committed versions seen {unacked_committed}, "
          f"data file {os.path.getsize(store_dir / 'data.mdb') >> 20} MiB")
    assert kill_phase["P"] >= ROUNDS // 3, kill_phase
    assert acked_total >= ROUNDS, acked_total
    assert len(floor) == KEYS
    assert os.path.getsize(store_dir / "data.mdb") == map_size_for(parse_size(CAPACITY))
