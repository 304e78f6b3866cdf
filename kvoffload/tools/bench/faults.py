"""Fault campaign on the LMDB tier: what survives a writer SIGKILLed mid-commit, random damage to the
data and lock files, and threads x processes hammering one store under evictions and reopens.

Every value is a function of its key, so every byte served anywhere is checked. The figures that matter
are zeros: wrong bytes served, acknowledged entries lost, crashed readers, stalls. Damaged stores are
opened in child processes, so a crash counts instead of ending the campaign. The concurrency part
(`concurrency`) is also the stress test of `make test`: its watchdog raises `Stall` when no process
makes progress for `stall_seconds` (after asking each child for its thread stacks)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import new_result

# Keys and values, shared with the child processes (run with `python -c`).
WORKLOAD = r'''
import random

import numpy as np


def value_of(key):
    """The only bytes `key` may be served as: its size and bytes follow from the key alone."""
    r = random.Random(key)
    n = r.randint(1 << 18, 3 << 20) if key.startswith(b"stress/") else r.randint(1, 64 << 10)
    words = (n + 7) // 8
    body = np.resize(np.frombuffer(r.randbytes(4096), np.uint64), words)
    body ^= np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return body.tobytes()[:n]
'''

KILLED_WRITER = (
    WORKLOAD
    + r"""
import os, sys
from kvoffload import open_store
url, ack_path, rnd = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = open_store(url)
acks = open(ack_path, "a")
r = random.Random(rnd)
print("ready", flush=True)
for i in range(1_000_000):
    keys = [b"kill/%d/%d/%d" % (rnd, i, j) for j in range(r.choice((1, 1, 2, 4)))]
    if all(store.put_many([(k, value_of(k)) for k in keys])):
        acks.write("".join(k.decode() + "\n" for k in keys))
        acks.flush()
        os.fsync(acks.fileno())
"""
)

READ_ALL = (
    WORKLOAD
    + r"""
import json, sys
from kvoffload import open_store
url, keys = sys.argv[1], sys.argv[2].split(",")
out = {"served": 0, "wrong": 0, "misses": 0}
with open_store(url) as store:
    for k in keys:
        v = store.get(k.encode())
        out["misses" if v is None else "served"] += 1
        out["wrong"] += v is not None and v != value_of(k.encode())
    assert store.put(b"after", b"works") and store.get(b"after") == b"works"
    out["reset"] = store.stats().get("damaged_files_reset", 0)
print(json.dumps(out))
"""
)

HAMMER = (
    WORKLOAD
    + r"""
import faulthandler, json, os, signal, sys, threading, time
from kvoffload import open_store

url, p, procs, seconds, beat_path, result_path, reopen_url = sys.argv[1:8]
p, procs, seconds = int(p), int(procs), float(seconds)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks on a stall
deadline, keys = time.monotonic() + seconds, 400
ops, errors, acked, lock = [0], [], [], threading.Lock()


def key_of(q, t, i):
    return b"stress/p%d/t%d/%05d" % (q, t, i)


def check(key, value):
    if value is not None and value != value_of(key):
        errors.append(f"{key!r} served {len(value)} bytes that are not its value")


def writer(store, t):
    r, i = random.Random(p * 100 + t), 0
    while time.monotonic() < deadline and i < keys:
        batch = [key_of(p, t, j) for j in range(i, min(keys, i + r.choice((1, 1, 2, 4))))]
        ok = store.put_many([(k, value_of(k)) for k in batch])
        with lock:
            acked.extend(k.decode() for k, good in zip(batch, ok) if good)
            ops[0] += 1
        i += len(batch)


def reader(store, t):
    r, out = random.Random(p * 100 + 50 + t), bytearray(3 << 20)
    while time.monotonic() < deadline:
        batch = [key_of(r.randrange(procs), r.randrange(2), r.randrange(keys // 8)) for _ in range(3)]
        if r.random() < 0.5:
            for k in batch:
                check(k, store.get(k))
        else:
            n = store.get_into(batch[0], out)
            check(batch[0], None if n is None else bytes(out[:n]))
        with lock:
            ops[0] += 1


def beat():
    while True:
        with open(beat_path + ".tmp", "w") as f:
            f.write(str(ops[0]))
        os.replace(beat_path + ".tmp", beat_path)
        time.sleep(0.2)


threading.Thread(target=beat, daemon=True).start()
if reopen_url != "-":  # open, write, read, close, again: with another capacity every other time
    r, i, stats = random.Random(p), 0, {}
    while time.monotonic() < deadline:
        with open_store(reopen_url if i % 2 else url) as s:
            k, other = key_of(p, 0, i % keys), key_of(0, 0, r.randrange(keys // 8))
            if s.put(k, value_of(k)):
                acked.append(k.decode())
            check(k, s.get(k))
            check(other, s.get(other))
            stats = s.stats()
        ops[0] += 1
        i += 1
else:
    store = open_store(url)
    threads = [threading.Thread(target=f, args=(store, t)) for f in (writer, reader) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = store.stats()
    store.close()
with open(result_path, "w") as f:
    json.dump({"errors": errors[:20], "acked": acked, "ops": ops[0],
               "stats": {k: v for k, v in stats.items() if isinstance(v, int)}}, f)
"""
)

_ns: dict = {}
exec(compile(WORKLOAD, "<faults workload>", "exec"), _ns)
value_of = _ns["value_of"]


class Stall(AssertionError):
    """No process made progress for the watchdog's whole period."""


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _child(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], env=_env(), **kwargs)


def kill_rounds(directory: str, rounds: int, seed: int = 0) -> dict:
    """A writer SIGKILLed at a random moment, `rounds` times on one store; after each kill every
    acknowledged entry must be there, exact (the capacity is far above what is written: nothing is evicted,
    so a missing entry is a lost one)."""
    url = f"lmdb://{directory}/killed?capacity=1GiB"
    ack_path = os.path.join(directory, "acks")
    rng = random.Random(seed)
    out: dict[str, Any] = {
        "rounds": rounds,
        "acknowledged": 0,
        "checks": 0,
        "lost": 0,
        "wrong_bytes": 0,
        "unacknowledged_served": 0,
    }
    from ...store import open_store

    for rnd in range(rounds):
        child = _child(KILLED_WRITER, url, ack_path, str(rnd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout is not None  # stdout=PIPE
        child.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.4))
        child.kill()
        child.communicate()
        with open(ack_path) as f:
            acked = {line.strip().encode() for line in f if line.strip()}
        with open_store(url) as store:
            out["checks"] += len(acked)
            for key in acked:
                value = store.get(key)
                out["lost"] += value is None
                out["wrong_bytes"] += value is not None and value != value_of(key)
            mine = [int(k.split(b"/")[2]) for k in acked if k.startswith(b"kill/%d/" % rnd)]
            for j in range(4):  # the batch in flight may have committed unacknowledged: whole if served
                key = b"kill/%d/%d/%d" % (rnd, max(mine, default=-1) + 1, j)
                if (value := store.get(key)) is not None:
                    out["unacknowledged_served"] += 1
                    out["wrong_bytes"] += value != value_of(key)
            out["evictions"] = store.stats()["evictions"]
        out["acknowledged"] = len(acked)
    return out


def _damage(path: str, rng: random.Random) -> str:
    data = os.path.join(path, "data.mdb")
    size = os.path.getsize(data)
    used = min(size, 2 << 20)  # where the entries are (a small store fills its file's start)
    kind = rng.choice(["flip", "flip", "page", "truncate", "lock"])
    if kind == "truncate":
        os.truncate(data, rng.randrange(4096, used))
    elif kind == "lock":
        os.unlink(os.path.join(path, "lock.mdb"))
    else:
        with open(data, "r+b") as f:
            for _ in range(rng.randint(1, 16) if kind == "flip" else 1):
                at = rng.randrange(0, used - 4096)
                f.seek(at)
                f.write(bytes(rng.randrange(256) for _ in range(1 if kind == "flip" else 4096)))
    return kind


def corruption_trials(directory: str, trials: int, seed: int = 0) -> dict:
    """Random damage to a copy of a filled store each trial (byte flips anywhere, a garbage page,
    truncation, a deleted lock file); a child opens it, reads every key and writes once more."""
    from ...store import open_store

    pristine = os.path.join(directory, "pristine")
    keys = [b"c/%d" % i for i in range(24)]
    with open_store(f"lmdb://{pristine}?capacity=4MiB") as store:
        assert all(store.put_many([(k, value_of(k)) for k in keys]))
    rng = random.Random(seed)
    out: dict[str, Any] = {
        "trials": trials,
        "kinds": {},
        "reads": 0,
        "served": 0,
        "misses": 0,
        "wrong_bytes": 0,
        "resets": 0,
        "crashed_or_failed": 0,
    }
    for _ in range(trials):
        trial = os.path.join(directory, "trial")
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(pristine, trial)
        kind = _damage(trial, rng)
        out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
        child = _child(
            READ_ALL,
            f"lmdb://{trial}?capacity=4MiB",
            ",".join(k.decode() for k in keys),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stdout, _ = child.communicate(timeout=120)
        if child.returncode != 0:
            out["crashed_or_failed"] += 1
            continue
        result = json.loads(stdout)
        out["reads"] += len(keys)
        for name in ("served", "misses", "reset"):
            out[name if name != "reset" else "resets"] += result[name]
        out["wrong_bytes"] += result["wrong"]
    return out


def concurrency(
    directory: str, seconds: float = 12.0, capacity: int = 48 << 20, procs: int = 3, stall_seconds: float = 40.0
) -> list[dict]:
    """`procs - 1` processes of two writer and two reader threads putting 0.25-3 MiB values into a store
    far smaller than what they write, and one process opening, writing, reading and closing it with
    another capacity every other time. Returns each process's report; raises `Stall` on a stall."""
    url = f"lmdb://{directory}/store?capacity={capacity}"
    reopen = f"lmdb://{directory}/store?capacity={capacity // 2}"
    children, beats, results = [], [], []
    try:
        for p in range(procs):
            beats.append(os.path.join(directory, f"beat{p}"))
            results.append(os.path.join(directory, f"result{p}.json"))
            children.append(
                _child(
                    HAMMER,
                    url,
                    str(p),
                    str(procs),
                    str(seconds),
                    beats[-1],
                    results[-1],
                    reopen if p == procs - 1 else "-",
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        _watch(children, beats, stall_seconds, deadline=time.monotonic() + seconds + 180)
        failed = [
            f"process {i} exited {c.returncode}: {c.communicate()[1].decode()[-2000:]}"
            for i, c in enumerate(children)
            if c.returncode != 0
        ]
        if failed:
            raise AssertionError("\n".join(failed))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()
    reports = []
    for path in results:
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def _watch(children, beats, stall_seconds: float, deadline: float) -> None:
    last: dict[str, str] = {}
    progress_at = time.monotonic()
    while any(c.poll() is None for c in children):
        now = time.monotonic()
        for path in beats:
            try:
                with open(path) as f:
                    count = f.read()
            except FileNotFoundError:
                continue
            if last.get(path) != count:
                last[path], progress_at = count, now
        if now - progress_at > stall_seconds or now > deadline:
            for c in children:
                if c.poll() is None:
                    c.send_signal(signal.SIGUSR1)  # thread stacks to its stderr
            time.sleep(1)
            for c in children:
                c.kill()
            stacks = "\n".join(c.communicate()[1].decode()[-3000:] for c in children)
            raise Stall(f"no progress for {now - progress_at:.0f} s (ops {last}); stacks:\n{stacks}")
        time.sleep(0.2)


def _plain(figures: dict) -> str:
    """A result's figures for a progress line: `name value, ...` (nested results left to the JSON)."""
    return ", ".join(f"{k} {v}" for k, v in figures.items() if not isinstance(v, (dict, list)))


def run(quick: bool = False, progress=None) -> dict:
    work = tempfile.mkdtemp(prefix="kvoffload-faults-")
    say = progress or (lambda message: None)
    try:
        say("[bench faults] SIGKILL rounds")
        kills = kill_rounds(work, 5 if quick else 50)
        say(f"[bench faults] SIGKILL rounds: {_plain(kills)}; corruption trials")
        damage = corruption_trials(work, 6 if quick else 100)
        say(f"[bench faults] corruption trials: {_plain(damage)}; threads x processes")
        reports = concurrency(work, seconds=4 if quick else 30)
        bad = ("checksum_failures", "bad_header", "length_mismatch", "read_errors", "damaged_files_reset")
        together = {
            "processes": len(reports),
            "operations": sum(r["ops"] for r in reports),
            "wrong_bytes": sum(len(r["errors"]) for r in reports),
            "evictions": sum(r["stats"].get("evictions", 0) for r in reports),
            "verification_failures": sum(r["stats"].get(n, 0) for r in reports for n in bad),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return new_result(
        "faults",
        quick,
        targets={"wrong_bytes": 0, "lost": 0, "crashed_or_failed": 0},
        results={"sigkill": kills, "corruption": damage, "concurrency": together},
    )
