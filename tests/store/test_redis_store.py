"""The Redis tier against real redis-server processes on 127.0.0.1: standalone, ACL users, a 3-node
Cluster (and one node killed), corrupt values, timeouts, and the tiers in front of it."""

import collections
import logging
import os
import signal

import pytest

from kvoffload.tools.bench.redis_server import Server
from kvoffload.store import StoreConfigError, open_store
from kvoffload.store import redis_store
from kvoffload.store.redis_store import NODE_RETRY_SECONDS, RedisStore
from support.clock import FakeClock
from support.redis_cluster import start_cluster

FP = b"f" * 16


@pytest.fixture
def server(start_server):
    return start_server()


@pytest.fixture
def start_server(tmp_path):
    """Start redis-servers with options (password, maxmemory, policy); all stopped after the test."""
    started = []

    def start(**options):
        started.append(Server(str(tmp_path), **options))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def cluster(tmp_path):
    nodes = start_cluster(str(tmp_path))
    yield nodes
    for node in nodes:
        node.stop()


def _raw(server):
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port)


def _values(n=20, size=5000):
    return [(f"page-{i}".encode(), os.urandom(size)) for i in range(n)]


class Network:
    """What redis-py sent where: per (what, port), the connection attempts ("connect": a socket opened)
    and the commands sent ("send": one per command or pipeline, a retry sent again), every client
    included (pipelines, stats, the cluster's slot-map reloads). A skipped node gets neither; a hung
    one costs a timeout per command sent to it."""

    def __init__(self):
        self.seen: collections.Counter = collections.Counter()

    def connects(self, server) -> int:
        return self.seen["connect", server.port]

    def sends(self, server) -> int:
        return self.seen["send", server.port]

    def touched(self, server) -> int:
        return self.connects(server) + self.sends(server)

    def clear(self) -> None:
        self.seen.clear()


@pytest.fixture
def network(monkeypatch):
    """A spy on redis-py's connections (their public send_packed_command / connect_check_health)."""
    from redis.connection import AbstractConnection

    spy = Network()
    send, connect = AbstractConnection.send_packed_command, AbstractConnection.connect_check_health

    def counting_send(self, *args, **kwargs):
        spy.seen["send", self.port] += 1
        return send(self, *args, **kwargs)

    def counting_connect(self, *args, **kwargs):
        if not self._sock:  # already connected: nothing goes out
            spy.seen["connect", self.port] += 1
        return connect(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting_send)
    monkeypatch.setattr(AbstractConnection, "connect_check_health", counting_connect)
    return spy


def test_round_trip_byte_exact_with_header(server):
    store = open_store(f"redis://{server.address}/0?namespace=t1", fingerprint=FP)
    items = _values()
    assert store.put_many(items) == [True] * len(items)
    assert store.contains_many([k for k, _ in items] + [b"absent"]) == [True] * len(items) + [False]
    for key, value in items:
        assert store.get(key) == value
    raw = _raw(server).get(b"kvoffload:t1:page-0")
    assert raw[:4] == b"KVOF" and raw[48:] == items[0][1]  # the LMDB entry header, then the page
    assert store.stats()["hits"] == len(items)


def test_corrupt_truncated_and_foreign_values_are_counted_misses(server):
    store = open_store(f"redis://{server.address}/0?namespace=t2", fingerprint=FP)
    items = _values(4)
    store.put_many(items)
    raw, prefix = _raw(server), b"kvoffload:t2:"
    raw.setrange(prefix + b"page-0", 100, b"\xff\x00")  # a flipped payload: checksum
    raw.set(prefix + b"page-1", raw.get(prefix + b"page-1")[:-7])  # truncated: length
    raw.set(prefix + b"page-2", b"not ours at all")  # no header
    assert [store.get(k) for k, _ in items[:3]] == [None, None, None]
    assert store.get(b"page-3") == items[3][1]
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["length_mismatch"] == 1 and stats["bad_header"] == 1
    other = open_store(f"redis://{server.address}/0?namespace=t2", fingerprint=b"g" * 16)
    assert other.get(b"page-3") is None and other.stats()["fingerprint_mismatch"] == 1  # another layout's page
    assert store.get(b"page-3") == items[3][1]  # is left in place for its own layout


def test_namespaces_are_separate(server):
    a = open_store(f"redis://{server.address}/0?namespace=a", fingerprint=FP)
    b = open_store(f"redis://{server.address}/0?namespace=b", fingerprint=FP)
    a.put(b"k", b"v" * 10)
    assert b.get(b"k") is None and a.get(b"k") == b"v" * 10


def test_clear_is_refused_with_a_reason_and_removes_nothing(server, caplog):
    """A connector's reset never clears Redis: it is shared by design (said, and False)."""
    store = open_store(f"redis://{server.address}/0?namespace=a", fingerprint=FP)
    store.claim("vllm")
    store.put(b"k", b"v" * 10)
    assert store.clear("vllm") is False
    assert store.get(b"k") == b"v" * 10
    assert "Redis's own tools" in caplog.text


def test_wrong_password_and_acl_users_fail_clearly_at_start(start_server):
    secured = start_server(password="s3cret")
    admin = __import__("redis").Redis(port=secured.port, password="s3cret")
    admin.acl_setuser("kvo", enabled=True, passwords=["+kvopw"], keys=["kvoffload:*"], commands=["+@all"])
    assert open_store(f"redis://:s3cret@{secured.address}/0", fingerprint=FP).put(b"k", b"v")
    assert open_store(f"redis://kvo:kvopw@{secured.address}/0", fingerprint=FP).get(b"k") == b"v"
    for url in (f"redis://:wrong@{secured.address}/0", f"redis://{secured.address}/0",
                f"redis://kvo:nope@{secured.address}/0"):
        with pytest.raises(StoreConfigError, match="refused the credentials") as err:
            open_store(url)
        assert "wrong" not in str(err.value) and "nope" not in str(err.value)  # no password in messages
    secured.stop()
    with pytest.raises(StoreConfigError, match="cannot reach Redis"):
        open_store(f"redis://{secured.address}/0")


def test_passwords_never_appear_in_urls_the_store_reports(start_server):
    secured = start_server(password="s3cret")
    store = open_store(f"redis://:s3cret@{secured.address}/0?namespace=x")
    tiered = open_store(f"tiered://?memory=1MiB&redis=redis://:s3cret@{secured.address}/0")
    for shown in (store.url, store.stats()["url"], tiered.url, repr(tiered)):
        assert "s3cret" not in shown and "***" in shown


def test_start_up_warns_without_maxmemory_and_lru(start_server, caplog):
    unbounded = start_server(maxmemory="0", policy="noeviction")
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.redis_store"):
        store = open_store(f"redis://{unbounded.address}/0")
    assert "grow without bound" in caplog.text and "allkeys-lru" in caplog.text
    assert store.capacity == 1 << 40  # nothing declared: the default report


def test_capacity_from_maxmemory_and_eviction_by_the_server(start_server, caplog):
    small = start_server(maxmemory="4mb", policy="allkeys-lru")
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.redis_store"):
        store = open_store(f"redis://{small.address}/0", fingerprint=FP)
    assert "grow without bound" not in caplog.text and store.capacity == 4 << 20
    items = [(f"v{i}".encode(), os.urandom(256 << 10)) for i in range(40)]  # 10 MiB into 4 MiB
    assert all(store.put_many(items))
    served = store.read_many([k for k, _ in items], lambda i, view: None)
    assert 0 < sum(served) < len(items)  # the server evicted; what is left reads back verified


def test_writes_go_out_in_bounded_pipelined_batches(server, monkeypatch):
    monkeypatch.setattr(redis_store, "PIPELINE_BYTES", 20_000)
    store = open_store(f"redis://{server.address}/0?namespace=p", fingerprint=FP)
    executed = []
    real = store.client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = real(*args, **kwargs)
        run = pipe.execute
        pipe.execute = lambda **kw: executed.append(len(pipe.command_stack)) or run(**kw)
        return pipe

    store.client.pipeline = counting_pipeline
    items = _values(12, 5000)
    assert all(store.put_many(items))
    assert len(executed) == 3 and sum(executed) == 12  # 4 values of 5000 bytes reach 20 000
    executed.clear()
    assert all(store.read_many([k for k, _ in items], lambda i, v: None))
    assert executed == [12]  # every key in one round trip


def test_a_dead_or_stalled_server_is_a_counted_miss_never_an_exception(server):
    store = open_store(f"redis://{server.address}/0?namespace=d&timeout=0.5", fingerprint=FP)
    items = _values(3)
    store.put_many(items)
    os.kill(server.proc.pid, signal.SIGSTOP)  # stalled: every call times out
    try:
        assert store.read_many([k for k, _ in items], lambda i, v: None) == [False] * 3
        assert store.put_many(items) == [False] * 3
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.kill()
    assert store.contains_many([k for k, _ in items]) == [False] * 3
    stats = store.stats()
    assert stats["read_errors"] >= 6 and stats["dropped_puts"] == 3 and stats["entries"] == -1


def _outage_calls(store, items):
    """Every store call, each of which must answer a miss or a dropped write."""
    keys = [k for k, _ in items]
    return [lambda: store.put_many(items), lambda: store.read_many(keys, lambda i, v: None),
            lambda: store.contains_many(keys), lambda: [store.delete(keys[0])]]


def test_a_hung_server_costs_one_timeout_then_is_skipped_until_it_is_back(server, network, caplog):
    """SIGSTOP: the kernel accepts connections, no reply comes. redis-py's default retries made every
    call take 15 s with timeout=1 (a command sent again per retry); now one command sent, one timeout,
    then misses without touching the network until the back-off (the store's clock, advanced here) ends."""
    clock = FakeClock()
    store = RedisStore(f"redis://{server.address}/0?namespace=h&timeout=1", fingerprint=FP, clock=clock)
    items = _values(3)
    assert all(store.put_many(items))
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload.store.redis_store"):
            network.clear()
            served = store.read_many([k for k, _ in items], lambda i, v: None)
            assert served == [False] * 3 and network.sends(server) == 1  # one attempt: one timeout, no retry
            network.clear()
            for call in _outage_calls(store, items):
                assert not any(call())
            stats = store.stats()
            assert stats["entries"] == -1
            assert network.touched(server) == 0  # skipped: no connection, no command, no timeout
            clock.advance(NODE_RETRY_SECONDS / 2)  # within the back-off: still skipped
            assert store.contains_many([items[0][0]]) == [False] and network.touched(server) == 0
        assert caplog.text.count("skipped for") == 1  # once per back-off, not once per call
        assert stats["read_errors"] == 9 and stats["dropped_puts"] == 3 and stats["write_errors"] == 4
        network.clear()
        with pytest.raises(StoreConfigError, match="cannot reach Redis"):  # start-up: one timeout too
            open_store(f"redis://{server.address}/0?timeout=1")
        assert network.connects(server) == 1 and network.sends(server) == 1  # one attempt, no retry
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    clock.advance(NODE_RETRY_SECONDS / 2 + 0.1)  # the back-off is over: the next call tries the server again
    network.clear()
    assert all(store.put_many(items)) and store.get(items[0][0]) == items[0][1]
    assert network.sends(server) >= 2


def test_a_dead_server_is_skipped_after_one_failed_call(server, network, caplog):
    clock = FakeClock()
    store = RedisStore(f"redis://{server.address}/0?namespace=k&timeout=1", fingerprint=FP, clock=clock)
    items = _values(3)
    server.kill()
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.redis_store"):
        for n, call in enumerate(_outage_calls(store, items) * 2):
            network.clear()
            assert not any(call())
            # the first call: one connection attempt, refused (no retry); the next: the node is skipped
            assert network.connects(server) == (1 if n == 0 else 0) and network.sends(server) == 0
        assert caplog.text.count("skipped for") == 1
        clock.advance(NODE_RETRY_SECONDS / 2)
        assert store.contains_many([items[0][0]]) == [False] and network.touched(server) == 0  # still skipped
        clock.advance(NODE_RETRY_SECONDS / 2 + 0.1)
        assert store.contains_many([items[0][0]]) == [False]
        assert network.connects(server) == 1  # tried again after the back-off: still dead
        assert caplog.text.count("skipped for") == 2
    stats = store.stats()
    assert stats["dropped_puts"] == 6 and stats["write_errors"] == 8
    assert stats["read_errors"] == 14  # read_many and contains_many of 3 keys twice each, then 2 of one key


def test_timeout_must_be_a_positive_number_and_bounds_connecting_too(server):
    for value in ("abc", "-1", "0", "1e999", "nan", ""):
        with pytest.raises(StoreConfigError, match=r"timeout=.*positive number"):
            open_store(f"redis://{server.address}/0?timeout={value}")
    options = open_store(f"redis://{server.address}/0?timeout=0.5").client.connection_pool.connection_kwargs
    assert options["socket_timeout"] == options["socket_connect_timeout"] == 0.5
    assert options["retry"].get_retries() == 0


def test_cluster_spreads_keys_and_survives_a_killed_node(cluster):
    seeds = ",".join(node.address for node in cluster[:2])
    store = open_store(f"redis+cluster://{seeds}/?namespace=c", fingerprint=FP)
    items = _values(60, 2000)
    assert all(store.put_many(items))
    assert all(_raw(node).dbsize() > 0 for node in cluster)  # sharded over all three primaries
    keys = [k for k, _ in items]
    assert sum(store.read_many(keys, lambda i, v: None)) == 60
    fresh = open_store(f"redis+cluster://{cluster[2].address}/?namespace=c", fingerprint=FP)  # another host
    assert all(fresh.get(k) == v for k, v in items)
    cluster[1].kill()
    served = store.read_many(keys, lambda i, v: None)
    assert 0 < sum(served) < 60  # fewer hits, no exception
    assert store.stats()["read_errors"] >= 60 - sum(served)
    written = store.put_many(items)
    assert 0 < sum(written) < 60 and store.stats()["dropped_puts"] == 60 - sum(written)
    for i, ok in enumerate(served):  # what is served is still the right bytes
        if ok:
            assert store.get(keys[i]) == items[i][1]


def test_a_hung_cluster_node_costs_one_timeout_then_is_skipped(cluster, network):
    store = open_store(f"redis+cluster://{cluster[0].address},{cluster[1].address}/?namespace=hc&timeout=1",
                       fingerprint=FP)
    items = _values(30, 1000)
    keys = [k for k, _ in items]
    assert all(store.put_many(items))
    hung = cluster[2]
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        network.clear()
        served = store.read_many(keys, lambda i, v: None)
        assert 0 < sum(served) < 30
        assert network.sends(hung) == 1  # one timeout, and the slot map reload skips the node
        lost = [k for k, ok in zip(keys, served) if not ok]
        network.clear()
        for call in _outage_calls(store, [(k, b"v") for k in lost]):
            assert not any(call())
        assert network.touched(hung) == 0  # skipped: no connection, no command, no timeout
        written = store.put_many(items)
        assert sum(written) == sum(served)  # the other nodes still take writes ...
        assert network.touched(hung) == 0 and all(network.sends(node) > 0 for node in cluster[:2])  # ... not it
        assert store.stats()["dropped_puts"] == 2 * len(lost)
    finally:
        os.kill(cluster[2].proc.pid, signal.SIGCONT)


def test_tls_form_is_passed_to_the_client(server, monkeypatch):
    import redis

    seen = {}
    real = redis.Redis.__init__

    def capture(self, *args, **kwargs):
        seen.update(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", capture)
    with pytest.raises(StoreConfigError, match="cannot reach Redis"):  # the server speaks plain TCP
        open_store(f"rediss://{server.address}/0?ssl_cert_reqs=none&ssl_ca_certs=/etc/ssl/certs/ca.pem")
    assert seen["ssl"] is True and seen["ssl_cert_reqs"] == "none" and seen["ssl_ca_certs"] == "/etc/ssl/certs/ca.pem"
    with pytest.raises(StoreConfigError, match="TLS options need rediss"):
        open_store(f"redis://{server.address}/0?ssl_ca_certs=/x")


def test_tiered_memory_lmdb_redis(server, tmp_path):
    url = f"tiered://?memory=8MiB&lmdb={tmp_path}/lmdb&redis=redis://{server.address}/0"
    items = _values(5)
    with open_store(url, fingerprint=FP) as first:
        assert all(first.put_many(items))
    # another host: its own empty memory and LMDB, the same Redis
    with open_store(f"tiered://?memory=8MiB&redis=redis://{server.address}/0", fingerprint=FP) as second:
        assert [second.get(k) for k, _ in items] == [v for _, v in items]
        assert second.stats()["disk_hits"] == 5
        assert [second.get(k) for k, _ in items] == [v for _, v in items]
        assert second.stats()["memory_hits"] == 5  # promoted into memory
    with pytest.raises(StoreConfigError, match="redis= takes"):
        open_store("tiered://?memory=1MiB&redis=lmdb:///x")


# -- the runner and vLLM on a shared Redis tier --------------------------------------------------------

def _check_all_equal(report):
    assert report["ok"], report["problems"]
    assert all(p["tokens_equal"] and p["pages_equal"] for p in report["prompts"])
    assert report["totals"]["restored_pages"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("front", ["", "tiered"])
def test_two_independent_runners_share_a_redis_tier(server, tiny_checkpoint, tmp_path, front):
    from kvoffload.tools.verify import verify

    url = f"redis://{server.address}/0?namespace=verify"
    if front:  # each process has its own (empty) memory in front of the shared Redis
        url = f"tiered://?memory=64MiB&redis=redis://{server.address}/0"
    report = verify(url, model_dir=tiny_checkpoint, separate=True)
    _check_all_equal(report)
    assert report["separate"] and report["counters"]["warm"]["loaded_pages"] > 0


@pytest.mark.slow
def test_runner_on_a_cluster_then_with_a_node_killed(cluster, tiny_checkpoint, tmp_path):
    from kvoffload.tools.verify import verify

    seeds = ",".join(node.address for node in cluster)
    report = verify(f"redis+cluster://{seeds}/?namespace=verify", model_dir=tiny_checkpoint, separate=True)
    _check_all_equal(report)
    full_hits = report["totals"]["hit_tokens"]
    cluster[0].kill()
    report = verify(f"redis+cluster://{cluster[1].address}/?namespace=verify", model_dir=tiny_checkpoint,
                    separate=True)
    assert all(p["tokens_equal"] for p in report["prompts"])  # same tokens
    assert report["totals"]["hit_tokens"] < full_hits  # fewer hits: a third of the pages is unreachable
    assert report["counters"]["cold"]["save_dropped"] > 0  # writes to the dead node dropped and counted


def test_a_reshard_under_way_is_a_miss_then_the_slot_map_recovers(cluster):
    import subprocess

    from kvoffload.tools.bench.redis_server import binary

    store = open_store(f"redis+cluster://{cluster[0].address}/?namespace=r", fingerprint=FP)
    items = _values(60, 2000)
    assert all(store.put_many(items))
    ids = [subprocess.run([binary("redis-cli"), "-p", str(n.port), "cluster", "myid"], capture_output=True,
                          text=True, check=True).stdout.strip() for n in cluster]
    # move 3000 slots (and their keys) from the first node to the second behind the client's back
    subprocess.run([binary("redis-cli"), "--cluster", "reshard", cluster[0].address, "--cluster-from", ids[0],
                    "--cluster-to", ids[1], "--cluster-slots", "3000", "--cluster-yes"], capture_output=True,
                   check=True, timeout=120)
    keys = [k for k, _ in items]
    first = store.read_many(keys, lambda i, v: None)  # a stale slot map: MOVED answers are misses
    assert 0 < sum(first) < 60 and store.stats()["read_errors"] == 60 - sum(first)
    second = []
    store.read_many(keys, lambda i, view: second.append((i, bytes(view))))
    assert len(second) == 60 and all(items[i][1] == value for i, value in second)  # the map was reloaded
