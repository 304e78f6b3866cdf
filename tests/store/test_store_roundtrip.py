"""Byte-exact round trips through every tier, in every API form, and across a process restart."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import store_urls, subprocess_env
from kvoffload import open_store
from kvoffload.store import TieredStore

SIZES = [1, 2, 7, 4095, 4096, 4097, 65536, 1 << 20, (1 << 20) + 3, 8 << 20]


def _value(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_random_values_round_trip(any_store):
    values = {f"k{i}".encode(): _value(i, size) for i, size in enumerate(SIZES)}
    for key, value in values.items():
        assert any_store.put(key, value) is True
    for key, value in values.items():
        assert any_store.get(key) == value
        assert any_store.contains(key)
    assert any_store.get(b"absent") is None
    assert not any_store.contains(b"absent")


def test_batched_forms_fill_caller_buffers(any_store):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 3000, 70000, 1 << 20)]
    keys = [b"a%d" % i for i in range(len(arrays))]
    assert any_store.put_many(list(zip(keys, arrays))) == [True] * len(arrays)
    outs = [np.zeros_like(a) for a in arrays]
    assert any_store.get_many(keys + [b"missing"], outs + [np.zeros(8, np.uint8)]) == \
        [a.nbytes for a in arrays] + [None]
    for out, array in zip(outs, arrays):
        assert np.array_equal(out, array)
    assert any_store.contains_many(keys + [b"missing"]) == [True] * len(keys) + [False]


def test_torch_tensors_in_and_out(any_store):
    page = torch.randn(16, 32, dtype=torch.float32).to(torch.bfloat16)
    assert any_store.put(b"page", page)
    restored = torch.empty_like(page)
    assert any_store.get_into(b"page", restored) == page.numel() * 2
    assert torch.equal(restored.view(torch.int16), page.view(torch.int16))


def test_destination_too_small_is_a_clear_error(any_store):
    any_store.put(b"k", b"x" * 100)
    with pytest.raises(ValueError, match="destination holds 10 bytes"):
        any_store.get_into(b"k", bytearray(10))


def test_overwrite_replaces_value(any_store):
    any_store.put(b"k", b"old value")
    any_store.put(b"k", b"new")
    assert any_store.get(b"k") == b"new"
    if isinstance(any_store, TieredStore):
        assert any_store.flush(10)  # entries are the disk's, written behind
    assert any_store.stats()["entries"] == 1
    assert any_store.delete(b"k") and any_store.get(b"k") is None
    assert not any_store.delete(b"k")


READER = """
import sys, numpy as np
from kvoffload import open_store
url, n = sys.argv[1], int(sys.argv[2])
with open_store(url, fingerprint=b"test-layout") as store:
    for i in range(n):
        size = int(np.random.default_rng(i).integers(1, 3 << 20))
        value = np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8).tobytes()
        assert store.get(b"key%d" % i) == value, i
print("ok", n)
"""


@pytest.mark.parametrize("tier", ["lmdb", "tiered"])
def test_new_process_serves_every_committed_entry(tmp_path, tier):
    url = store_urls(tmp_path, capacity="512MiB")[tier]
    n = 40
    with open_store(url, fingerprint=b"test-layout") as store:
        for i in range(n):
            size = int(np.random.default_rng(i).integers(1, 3 << 20))
            value = np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8).tobytes()
            assert store.put(b"key%d" % i, value)
            if tier == "tiered":  # committed = written behind; a full queue would drop (by design, counted)
                assert store.flush(60)
    out = subprocess.run([sys.executable, "-c", READER, url, str(n)], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(n)]


def test_tiered_promotes_disk_hits_to_memory(tmp_path):
    url = store_urls(tmp_path)["tiered"]
    with open_store(url) as store:
        store.put(b"k", b"v" * 1000)
    with open_store(url) as store:  # memory tier is empty after a restart
        assert store.get(b"k") == b"v" * 1000
        assert store.get(b"k") == b"v" * 1000
        stats = store.stats()
    assert stats["disk_hits"] == 1 and stats["memory_hits"] == 1 and stats["promotions"] == 1


def test_fingerprint_mismatch_is_a_counted_miss(tmp_path):
    url = store_urls(tmp_path)["lmdb"]
    with open_store(url, fingerprint=b"layout-A") as store:
        store.put(b"k", b"payload of layout A")
    with open_store(url, fingerprint=b"layout-B") as store:
        assert store.get(b"k") is None
        assert store.stats()["fingerprint_mismatch"] == 1
    with open_store(url, fingerprint=b"layout-A") as store:  # left in place for its own layout
        assert store.get(b"k") == b"payload of layout A"


def test_clear_removes_everything_for_its_only_namespace(any_store, tmp_path):
    """A connector's reset: every entry gone (values waiting to be written behind too), the accounting
    at zero, and the store usable again; a persistent tier remembers the claim across a reopen."""
    any_store.claim("ns-a")
    values = {f"c{i}".encode(): _value(i, 70000) for i in range(6)}
    assert any_store.put_many(list(values.items())) == [True] * len(values)
    assert any_store.clear("ns-a") is True
    assert any_store.contains_many(list(values)) == [False] * len(values)
    assert any_store.get(b"c0") is None
    if isinstance(any_store, TieredStore):
        assert any_store.flush(10)
        assert any_store.back.contains_many(list(values)) == [False] * len(values)
    assert any_store.stats()["entries"] == 0 and any_store.stats()["bytes_used"] == 0
    assert any_store.put(b"after", b"x" * 5000) and any_store.get(b"after") == b"x" * 5000


def test_clear_refuses_a_store_another_namespace_uses(any_store):
    any_store.claim("ns-a")
    any_store.claim("ns-b")
    assert any_store.put(b"k", b"value")
    assert any_store.clear("ns-a") is False
    assert any_store.get(b"k") == b"value"


def test_lmdb_remembers_its_namespaces_across_reopens(tmp_path):
    url = store_urls(tmp_path)["lmdb"]
    with open_store(url) as first:
        first.claim("other-deployment")
        assert first.put(b"k", b"value")
    with open_store(url) as second:
        second.claim("ns-a")
        assert second.clear("ns-a") is False and second.get(b"k") == b"value"
