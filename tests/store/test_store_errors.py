"""Bad URLs, directories and options fail at open with a message that says what to change."""

import os
import subprocess
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
    assert parse_size("1PiB") == 1 << 50 and parse_size("2PB") == 2 * 10**15 and parse_size("7EiB") == 7 << 60
    with pytest.raises(StoreConfigError, match="too large: at most .* bytes \\(8 EiB\\)"):
        parse_size("8EiB")


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


def test_a_read_only_filesystem_is_named_as_such(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(StoreConfigError, match="is on a read-only filesystem"):
            open_store(f"lmdb://{mount}?capacity=1MiB")
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_store_directory_is_private(tmp_path):
    with open_store(f"lmdb://{tmp_path}/new/store?capacity=1MiB"):
        pass
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "store").st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "store" / name).st_mode) & 0o077 == 0


def test_existing_open_directory_is_tightened(tmp_path):
    path = tmp_path / "shared"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    with open_store(f"lmdb://{path}?capacity=1MiB"):
        pass
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_incompatible_format_version(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity=1MiB"
    with open_store(url) as store:
        store.put(b"k", b"v")
    env = lmdb.open(f"{tmp_path}/db", max_dbs=8)
    info = env.open_db(b"info")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", (99).to_bytes(8, "big"), db=info)
    env.close()
    with pytest.raises(IncompatibleStoreError, match="format version 99"):
        open_store(url)


def test_capacity_too_small_for_a_store_and_entries_over_a_quarter(tmp_path):
    from kvoffload.store import EntryTooLargeError

    with pytest.raises(StoreConfigError, match="too small"):
        open_store(f"lmdb://{tmp_path}/tiny?capacity=1000")
    with open_store(f"lmdb://{tmp_path}/db?capacity=64KiB") as store:
        with pytest.raises(EntryTooLargeError, match="cannot fit"):
            store.put(b"k", b"x" * (16 * 1024 + 1))  # over a quarter of the capacity
        assert store.put(b"k", b"x" * (16 * 1024))


# -- sizes, fragments and passwords in URLs -----------------------------------------------------------

def test_sizes_are_exact_and_bounded():
    assert parse_size("0.5KiB") == 512
    assert parse_size("1.000000000000000000000000000001TiB") == 1 << 40  # no float rounding either way
    assert parse_size("0.0000000000009094947017729282379150390625TiB") == 1  # 2**-40 TiB, 40 decimals
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
    assert parse_size("0" * 500 + "7") == 7
    for text in (str(2**63), "9" * 400, "8589934592GiB", "9" * 5000 + ".5"):
        with pytest.raises(StoreConfigError, match="too large"):
            parse_size(text)
    with pytest.raises(StoreConfigError, match="too large"):
        parse_size(2**64)


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e3", "1e400", "0x10", "1.5.2GiB",
                                  "\u0663", "", "GiB"])
def test_sizes_that_are_not_numbers(text):
    with pytest.raises(StoreConfigError, match="invalid capacity"):
        parse_size(text, "capacity")


def test_huge_capacity_in_a_url_is_a_config_error():
    with pytest.raises(StoreConfigError, match="memory capacity .* too large"):
        open_store("memory://?capacity=" + "9" * 400)
    with pytest.raises(StoreConfigError, match="too large"):
        open_store("tiered://?memory=1GiB&lmdb=/tmp/x&lmdb_capacity=" + "9" * 400)


@pytest.mark.parametrize("url", ["lmdb:///proc/kvoffload/kv#1?capacity=1GiB", "memory://?capacity=1GiB#x", "memory://#",
                                 "tiered://?memory=1GiB&lmdb=/proc/kvoffload/a#b"])
def test_a_fragment_is_refused_not_dropped(url):
    with pytest.raises(StoreConfigError, match="%23"):
        open_store(url)


def test_percent_encoded_hash_in_a_path(tmp_path):
    with open_store(f"lmdb://{tmp_path}/kv%231?capacity=1MiB") as store:
        store.put(b"k", b"v")
    assert (tmp_path / "kv#1" / "data.mdb").exists()


SECRET = "Sx7q"


@pytest.mark.parametrize("url, message", [
    (f"redis://u:{SECRET}@h:1/0?namespace=a&namespace=b", "given twice"),
    (f"redix://u:{SECRET}@h:1/0", "unknown store scheme"),
    (f"redix://u:p&{SECRET}@h:1/0", "unknown store scheme"),
    (f"redix://us@er:{SECRET}@p{SECRET}@h:1/0", "unknown store scheme"),
    (f"tiered://?memory=1GiB&redis=http://u:{SECRET}@h:1/0", "redis= takes"),
    (f"tiered://?memory=1GiB&redis=http%3A%2F%2Fu%3A{SECRET}%40h%3A1%2F0", "redis= takes"),
    (f"tiered://?redis=u:{SECRET}@h:1", "invalid store URL"),
    (f"tiered://u:{SECRET}@h/?memory=1GiB", "needs lmdb="),
    (f"memory://u:{SECRET}@h/", "takes no path"),
    (f"redis://u:{SECRET}#x@h:1/0", "%23"),
    (f"redis://u:{SECRET}@[::1/0", "invalid store URL"),
    (f"u:{SECRET}@h:6379", "invalid store URL"),
])
def test_errors_never_show_a_password(url, message):
    with pytest.raises(StoreConfigError, match=message) as exc:
        open_store(url)
    assert SECRET not in str(exc.value)


def test_redact_url_keeps_what_is_not_a_password():
    from urllib.parse import quote

    from kvoffload.store.url import redact_url

    for url, shown in [
        ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:secret@host/0?namespace=a", "redis://:***@host/0?namespace=a"),
        ("rediss+cluster://u:pw@h1:1,h2:2/?namespace=x", "rediss+cluster://u:***@h1:1,h2:2/?namespace=x"),
        ("redis://us@er:secret@host/0", "redis://us@er:***@host/0"),
        ("redis://user:pa&ss@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://user:p@ss@host/0", "redis://user:***@host/0"),
        ("tiered://?memory=1GiB&redis=redis%3A%2F%2Fu%3Apw%40h%3A1%2F0",
         "tiered://?memory=1GiB&redis=redis%3A%2F%2Fu%3A***%40h%3A1%2F0"),
        ("tiered://?memory=1GiB&redis=redis://u:pw@h:1/0", "tiered://?memory=1GiB&redis=redis://u:***@h:1/0"),
        ("tiered://?redis=" + quote("redis://u:p@w@h:1/0?namespace=n", safe="") + "&lmdb=/d",
         "tiered://?redis=redis%3A%2F%2Fu%3A***%40h%3A1%2F0%3Fnamespace%3Dn&lmdb=/d"),
    ] + [(url, url) for url in ("redis://host:6379/0", "lmdb:///data/kv?capacity=1GiB", "memory://?capacity=4GiB",
                                "tiered://?memory=1GiB&lmdb=/x&lmdb_capacity=2GiB", "redis://user@host/0",
                                "not a url")]:
        assert redact_url(url) == shown, url


def test_redact_url_never_leaks_a_password_character():
    """Passwords made of marked chunks joined by URL delimiters, raw and %-encoded, top-level and
    nested: no chunk may survive. Host text may go with the password (conservative), nothing else."""
    import random
    import re
    from urllib.parse import quote

    from kvoffload.store.url import redact_url

    rng = random.Random(7)
    delimiters = ["&", "@", ":", "/", "?", "%40", "%3A", "#", "=", "%", ",", "+", ";", "%2540", " "]
    passwords = ["pa&ss", "p@ss", "p:ss", "pa/ss", "p?ss", "p%40ss", "a@b:c/d?e&f%40g"]
    passwords += ["".join(f"{d}{c}" for c in ("pa", "ss", "wd")[: rng.randint(1, 3)] for d in rng.choices(delimiters))
                  + rng.choice(delimiters + [""]) for _ in range(300)]
    for password in passwords:
        marked = re.sub(r"[a-z]+", lambda m: "Q" + m.group(0) + "Z", password)  # every letter run is secret
        for user in ("user", "", "us@er", "us%40er"):
            inner = f"redis://{user}:{marked}@host:6379/0"
            for url in (inner, f"tiered://?memory=1GiB&redis={inner}", f"tiered://?redis={inner}&memory=1GiB",
                        f"tiered://?memory=1GiB&redis={quote(inner, safe='')}",
                        f"tiered://?memory=1GiB&redis={quote(quote(inner, safe=''), safe='')}"):
                shown = redact_url(url)
                assert not re.search(r"Q[a-z]+Z", shown), (url, shown)
                assert url.startswith("tiered") == ("memory=1GiB" in shown), (url, shown)


@pytest.mark.parametrize("url", [
    "memory://?capacity=1GiB&pinned=false&reserve=true&evict=s3fifo",
    "lmdb:///var/cache/kv%20store?capacity=64MiB",
    "redis://user:p%40ss%3Aword@cache.example:6380/3?namespace=team&timeout=0.5&capacity=1GiB",
    "rediss+cluster://:secret@a:7000,b:7001/?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem",
    "tiered://?memory=64MiB&lmdb=/var/db&lmdb_capacity=1GiB&write=behind&behind_bytes=8MiB&behind_age=5&admit=2"
    "&redis=redis%3A%2F%2Fu%3Asecret%40h%3A1%2F0%3Fnamespace%3Dn&evict=s3fifo",
    "tiered://?lmdb=/var/db&write=through",
])
def test_every_scheme_spec_round_trips_and_redacts(url):
    """URL -> spec -> URL: the canonical URL parses back to an equal spec; the redacted one (and the
    spec's repr) never shows a password."""
    from kvoffload.store import parse_store_url

    spec = parse_store_url(url)
    assert parse_store_url(spec.url(redact=False)) == spec
    assert "secret" not in spec.url() and "p%40ss" not in spec.url() and "secret" not in repr(spec)
    assert "secret" in spec.url(redact=False) or "secret" not in url
    assert parse_store_url(spec.url()).__class__ is spec.__class__


def test_spec_values_are_typed_and_defaulted():
    from kvoffload.store import LMDBSpec, MemorySpec, RedisSpec, TieredSpec, parse_store_url

    assert parse_store_url("memory://") == MemorySpec(4 << 30)
    assert parse_store_url("lmdb:///d?capacity=1MiB") == LMDBSpec("/d", 1 << 20)
    redis = parse_store_url("redis://u:pw@h:7/2?timeout=0.25")
    assert (redis.hosts, redis.db, redis.username, redis.password, redis.timeout) == ((("h", 7),), 2, "u", "pw", 0.25)
    assert isinstance(redis, RedisSpec) and redis.namespace == "default" and redis.capacity is None
    tiered = parse_store_url("tiered://?lmdb=/d&memory=1MiB")
    assert tiered == TieredSpec(MemorySpec(1 << 20), LMDBSpec("/d", 16 << 30))


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", ""])
def test_a_bad_redis_timeout_is_a_store_config_error_naming_the_option(value):
    """Refused when the URL is parsed, before any connection (no server needed)."""
    from kvoffload.errors import ConfigError
    from kvoffload.store import parse_store_url

    nested = f"tiered://?lmdb=/d&redis=redis%3A%2F%2Fh%3A1%2F0%3Ftimeout%3D{value}"
    for url in (f"redis://h:1/0?timeout={value}", nested):
        with pytest.raises(StoreConfigError, match=r"timeout=.*positive number") as raised:
            parse_store_url(url)
        assert isinstance(raised.value, ConfigError)


def test_the_url_hint_names_every_scheme():
    with pytest.raises(StoreConfigError) as raised:
        open_store("nothing")
    assert all(s in str(raised.value) for s in ("memory://", "lmdb://", "redis://", "tiered://"))


def test_shared_store_fixes_the_fingerprint_at_open(tmp_path):
    """Presence-only callers (fingerprint None: vLLM's scheduler) get the store open now; a store is
    never given another fingerprint once open: one opened for presence only is reopened with the first
    fingerprint asked for (what it holds kept), one open for another layout is refused."""
    from kvoffload.store import shared_store

    url = f"lmdb://{tmp_path}/a?capacity=64MiB"
    store = shared_store(url, fingerprint=b"layout-A")
    assert store.put(b"k", b"v" * 64)
    assert shared_store(url) is store and shared_store(url, fingerprint=b"layout-A") is store
    with pytest.raises(StoreConfigError, match="another layout fingerprint"):
        shared_store(url, fingerprint=b"layout-B")
    assert store.get(b"k") == b"v" * 64  # still layout A's
    store.close()
    other = f"lmdb://{tmp_path}/b?capacity=64MiB"
    presence = shared_store(other)
    assert presence.put(b"k", b"w" * 64) and presence.contains_many([b"k"]) == [True]
    assert presence.get(b"k") == b"w" * 64  # no fingerprint on either side
    with_layout = shared_store(other, fingerprint=b"layout-A")
    assert with_layout is not presence and shared_store(other) is with_layout
    assert with_layout.contains_many([b"k"]) == [True] and with_layout.get(b"k") is None  # another layout's
    assert with_layout.stats()["fingerprint_mismatch"] == 1
    with_layout.close()


def test_a_presence_only_tiered_store_reserves_no_memory(tmp_path):
    """vLLM's scheduler opens the store for lookups only: its memory tier (on a GPU host, a page-locked
    arena of the whole capacity) must not be reserved there; the workers' store, with a fingerprint, is."""
    from kvoffload.store import shared_store

    url = f"tiered://?memory=64MiB&reserve=true&pinned=false&lmdb={tmp_path}/db&lmdb_capacity=64MiB"
    presence = shared_store(url)
    assert presence.front.stats()["arena_bytes"] == 0 and not presence.front.pinned
    assert presence.contains_many([b"k"]) == [False]
    store = shared_store(url, fingerprint=b"layout-A")
    assert store is not presence and store.front.stats()["arena_bytes"] == 64 << 20
    store.close()
