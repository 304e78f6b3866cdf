"""The Mooncake tier against a real `mooncake_master` on 127.0.0.1 (the mooncake extra's wheel, its own
HTTP metadata server, TCP transport); no mock. Round trip, tenants, damaged values, the master killed
and restarted or hung, a writer killed mid-put, a contributor's exit and a full pool (misses, never
wrong bytes), the tiers in front of it, and a fresh process on another host (a network namespace)
restoring a prefix only the pool holds."""

import logging
import os
import subprocess
import sys
import time
from urllib.parse import quote

import numpy as np
import pytest

from kvoffload.store import EntryTooLargeError, StoreConfigError, open_store
from kvoffload.store.url_config import MooncakeSpec, parse_store_url
from kvoffload.tools.bench.mooncake_server import Master, binary

FP = b"f" * 16


@pytest.fixture
def master():
    binary()  # the wheel's binary must be there: a missing one fails, never skips
    with Master() as m:
        yield m


def _values(n=20, size=5000, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"page-{i}".encode(), rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for i in range(n)]


def _contributor(master, segment="64MiB"):
    """A separate long-lived process holding a segment of the pool (kvoffload.tools.mooncake_pool)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.tools.mooncake_pool", master.url(segment=segment, namespace="pool")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout.readline().startswith("contributing"), "the contributor did not join the pool"
    return proc


def test_url_grammar_round_trips_and_refuses_bad_options():
    spec = parse_store_url("mooncake://10.0.0.5:50051?segment=0&namespace=t1&buffer=64MiB")
    assert isinstance(spec, MooncakeSpec) and spec.segment == 0 and spec.buffer == 64 << 20
    assert spec.metadata == "http://10.0.0.5:8080/metadata" and parse_store_url(spec.url(redact=False)) == spec
    for bad, said in [
        ("mooncake://", "master's address"),
        ("mooncake://h:0", "port"),
        ("mooncake://h?protocol=udp", "tcp or rdma"),
        ("mooncake://h?device=mlx5_0", "protocol=rdma"),
        ("mooncake://h?buffer=4KiB", "at least 1MiB"),
        ("mooncake://h/x", "no path"),
        ("mooncake://u:pw@h", "one master"),
        ("mooncake://h?timeout=0", "positive number"),
        ("tiered://?redis=redis://h&mooncake=mooncake://h", "one shared tier"),
    ]:
        with pytest.raises(StoreConfigError, match=said):
            parse_store_url(bad)


def test_no_master_is_a_clear_error_at_start_up(master):
    master.stop()
    started = time.monotonic()
    with pytest.raises(StoreConfigError, match="no master answers"):
        open_store(master.url(segment="16MiB"), fingerprint=FP)
    assert time.monotonic() - started < 10


def test_round_trip_byte_exact_in_batches_and_a_value_over_the_buffer_is_refused(master):
    store = open_store(master.url(segment="128MiB", buffer="8MiB"), fingerprint=FP)
    items = _values(40, 300_000)  # 12 MB: more than one transfer buffer each way
    assert store.put_many(items) == [True] * 40
    assert store.contains_many([k for k, _ in items] + [b"absent"]) == [True] * 40 + [False]
    assert [store.get(k) for k, _ in items] == [v for _, v in items]
    outs = [bytearray(300_000) for _ in items]
    assert store.get_many([k for k, _ in items], outs) == [300_000] * 40
    assert [bytes(o) for o in outs] == [v for _, v in items]
    with pytest.raises(EntryTooLargeError):  # over the 8 MiB transfer buffer: refused before anything moves
        store.put_many([(b"huge", os.urandom(9 << 20))])
    stats = store.stats()
    assert stats["puts"] == 40 and stats["dropped_puts"] == 0 and stats["hits"] == 80
    store.close()


def test_namespaces_are_separate(master):
    a = open_store(master.url(segment="32MiB", namespace="a"), fingerprint=FP)
    b = open_store(master.url(segment=0, namespace="b"), fingerprint=FP)
    a.put(b"k", b"tenant a")
    assert b.get(b"k") is None and b.contains_many([b"k"]) == [False]
    b.put(b"k", b"tenant b")
    assert a.get(b"k") == b"tenant a" and b.get(b"k") == b"tenant b"
    b.close()
    a.close()


def test_damaged_and_foreign_values_are_counted_misses_and_a_save_replaces_them(master, caplog):
    from mooncake.store import MooncakeDistributedStore

    store = open_store(master.url(segment="32MiB", namespace="t"), fingerprint=FP)
    items = _values(3, 4000)
    assert all(store.put_many(items))
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{master.rpc_port}") == 0
    name = store.prefix.decode() + items[0][0].hex()
    good = raw.get(name)
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert raw.upsert(name, bytes(flipped)) == 0  # one bit of the page
    assert raw.upsert(store.prefix.decode() + items[1][0].hex(), b"not an entry") == 0
    open_store(master.url(segment=0, namespace="t"), fingerprint=b"g" * 16).put(items[2][0], b"another layout")
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.mooncake_store"):
        assert store.read_many([k for k, _ in items], lambda i, view: None) == [False] * 3
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["bad_header"] == 1 and stats["fingerprint_mismatch"] == 1
    assert "failed verification" in caplog.text
    assert all(store.put_many(items))  # upserts: the next save replaces a damaged value whole
    assert [store.get(k) for k, _ in items] == [v for _, v in items]
    raw.close()
    store.close()


def test_master_killed_gives_counted_misses_at_once_then_restarted_serves_again(master):
    store = open_store(master.url(segment="32MiB"), fingerprint=FP)
    items = _values(10, 2000)
    assert all(store.put_many(items))
    master.kill()
    started = time.monotonic()
    assert store.put_many(items) == [False] * 10  # no exception into the caller
    assert [store.get(k) for k, _ in items] == [None] * 10
    assert store.contains_many([k for k, _ in items]) == [False] * 10
    assert time.monotonic() - started < 5
    stats = store.stats()
    assert stats["write_errors"] >= 10 and stats["read_errors"] >= 10
    master.start()  # same ports; a master keeps its objects in memory only: the old values are gone
    deadline = time.monotonic() + 60
    while not all(store.put_many(items)):  # the back-off ends, the client mounts its segment again
        assert time.monotonic() < deadline, "the tier did not serve again after the master came back"
        time.sleep(0.5)
    assert [store.get(k) for k, _ in items] == [v for _, v in items]
    store.close()


def _wait_until_stopped(pid: int) -> None:
    """Return once every thread of `pid` is stopped (SIGSTOP reaches each thread when it next runs)."""
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited
                pass
        if all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"the master did not stop: thread states {states}"
        time.sleep(0.01)


def test_a_hung_master_costs_one_timeout_then_is_skipped_and_serves_again(master):
    import signal

    store = open_store(master.url(segment="32MiB", timeout=1), fingerprint=FP)
    items = _values(5, 2000)
    assert all(store.put_many(items))
    master.process.send_signal(signal.SIGSTOP)  # alive, answering nothing: Mooncake's own calls wait 30 s+
    try:
        _wait_until_stopped(master.process.pid)  # a running thread may still answer one call before it stops
        started = time.monotonic()
        assert store.get(b"never written") is None  # only the master knows (a held value may be read without it)
        assert store.put_many(items) == [False] * 5
        assert time.monotonic() - started < 1.9  # one timeout (timeout=1), then the pool is skipped
        started = time.monotonic()
        assert store.put_many(items) == [False] * 5 and store.contains_many([items[0][0]]) == [False]
        assert time.monotonic() - started < 0.5  # skipped at once while backed off
        assert store.stats()["read_errors"] >= 1 and store.stats()["write_errors"] >= 5
    finally:
        master.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while store.get(items[0][0]) != items[0][1]:  # the back-off ends; the values were never lost
        assert time.monotonic() < deadline, "the tier did not serve again after the master woke"
        time.sleep(0.5)
    store.close()


def test_a_writer_killed_mid_put_leaves_no_partial_value(master):
    code = (
        "import sys, numpy as np; from kvoffload.store import open_store; "
        "s = open_store(sys.argv[1], fingerprint=b'f' * 16); print('open', flush=True)\n"
        "for i in range(10**6): s.put(b'v%d' % i, np.full(4 << 20, i % 251, np.uint8).tobytes())"
    )
    pool = _contributor(master, "256MiB")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, master.url(segment=0)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout.readline().strip() == "open"
        time.sleep(1.0)  # puts under way
        proc.kill()
        proc.wait()
        store = open_store(master.url(segment=0), fingerprint=FP)
        seen = 0
        for i in range(400):
            value = store.get(b"v%d" % i)
            if value is not None:  # whole and verified, or nothing
                assert value == bytes([i % 251]) * (4 << 20)
                seen += 1
        assert seen > 0 and store.stats()["checksum_failures"] == 0
        store.close()
    finally:
        pool.terminate()
        pool.wait()


def test_a_contributors_exit_and_a_full_pool_give_misses_never_wrong_bytes(master):
    pool = _contributor(master, "32MiB")
    store = open_store(master.url(segment=0), fingerprint=FP)  # a client only: values live in the pool's segment
    items = _values(8, 1 << 20, seed=1)
    assert all(store.put_many(items))
    assert [store.get(k) for k, _ in items] == [v for _, v in items]
    more = _values(60, 1 << 20, seed=2)  # 60 MiB into a 32 MiB segment: Mooncake evicts
    store.put_many([(b"more-" + k, v) for k, v in more])
    got = [store.get(b"more-" + k) for k, _ in more] + [store.get(k) for k, _ in items]
    expected = [v for _, v in more] + [v for _, v in items]
    assert any(g is None for g in got) and any(g is not None for g in got)
    assert all(g is None or g == e for g, e in zip(got, expected))
    pool.kill()  # the contributor dies: its segment goes after the master's client_ttl
    pool.wait()
    deadline = time.monotonic() + 30
    while any(store.contains_many([b"more-" + k for k, _ in more])):
        assert time.monotonic() < deadline, "the dead contributor's values stayed listed"
        time.sleep(0.5)
    assert all(store.get(b"more-" + k) is None for k, _ in more)
    assert store.stats()["checksum_failures"] == 0
    store.close()


def test_tiered_writes_behind_into_the_pool_and_a_fresh_host_reads_through(master, tmp_path):
    pool = _contributor(master, "64MiB")
    try:
        shared = quote(master.url(segment=0, namespace="tiered"), safe="")
        items = _values(30, 20_000)
        with open_store(f"tiered://?memory=8MiB&mooncake={shared}", fingerprint=FP) as store:
            assert all(store.put_many(items))
        direct = open_store(master.url(segment=0, namespace="tiered"), fingerprint=FP)
        assert direct.contains_many([k for k, _ in items]) == [True] * 30  # written behind, reached the pool
        direct.close()
        fresh = f"tiered://?memory=8MiB&lmdb={tmp_path}/lmdb&lmdb_capacity=64MiB&mooncake={shared}"
        with open_store(fresh, fingerprint=FP) as store:
            assert [store.get(k) for k, _ in items] == [v for _, v in items]
        lmdb = open_store(f"lmdb://{tmp_path}/lmdb?capacity=64MiB", fingerprint=FP)
        assert lmdb.contains_many([k for k, _ in items]) == [True] * 30  # read-through copied them into LMDB
    finally:
        pool.terminate()
        pool.wait()


class _TwoHosts:
    """Host B: a network namespace of its own joined to this one (host A) by a veth pair, on a /24 of
    addresses no other host uses; `b(cmd)` runs a command on host B."""

    def __init__(self):
        import random

        tag = f"kvo{os.getpid() % 100000}"
        self.ns, self.veth = f"{tag}b", (f"{tag}a", f"{tag}b")
        net = f"10.213.{random.randrange(1, 250)}"
        self.a, self.b_address = f"{net}.1", f"{net}.2"
        steps = [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1]],
            ["ip", "link", "set", self.veth[1], "netns", self.ns],
            ["ip", "addr", "add", f"{self.a}/24", "dev", self.veth[0]],
            ["ip", "link", "set", self.veth[0], "up"],
            ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.b_address}/24", "dev", self.veth[1]],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.veth[1], "up"],
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"],
            # every address of host A through the link (Mooncake's TCP transport names its host's own)
            ["ip", "netns", "exec", self.ns, "ip", "route", "add", "default", "via", self.a],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                self.close()
                raise OSError(f"{' '.join(step)}: {done.stderr.strip()}")

    def b(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.veth[0]], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


@pytest.mark.slow
def test_two_hosts_a_prefix_saved_on_one_is_restored_on_the_other(tiny_checkpoint, monkeypatch):
    """Host A (this network namespace) runs the master, a pool contributor and the cold runner; host B
    (a namespace of its own behind a veth pair) runs the warm runner, a fresh process that reaches the
    pool over the link only: tokens equal to the cold run, pages byte-equal. Where namespaces cannot be
    made (no root, no `ip`), the test says so and runs the same flow over loopback."""
    import warnings

    from kvoffload.tools import verify as verify_module

    try:
        hosts = _TwoHosts()
    except OSError as exc:
        warnings.warn(f"no network namespaces here ({exc}): the two-host flow runs over loopback", stacklevel=1)
        hosts = None
    try:
        with Master(host=hosts.a if hosts else "127.0.0.1") as master:
            pool = _contributor(master, "256MiB")
            real_run, calls = subprocess.run, []

            def warm_on_host_b(cmd, *args, **kwargs):  # verify's second phase process: on host B
                if "kvoffload.tools.verify" not in cmd:
                    return real_run(cmd, *args, **kwargs)
                calls.append(cmd)
                return real_run(hosts.b(cmd) if hosts and len(calls) == 2 else cmd, *args, **kwargs)

            monkeypatch.setattr(verify_module.subprocess, "run", warm_on_host_b)
            try:
                url = master.url(segment=0, namespace="two-hosts")
                report = verify_module.verify(url, model_dir=tiny_checkpoint, separate=True)
            finally:
                pool.terminate()
                pool.wait()
    finally:
        if hosts:
            hosts.close()
    assert len(calls) == 2
    assert report["ok"], report["problems"]
    assert all(p["tokens_equal"] and p["pages_equal"] for p in report["prompts"])
    assert report["counters"]["warm"]["loaded_pages"] > 0
