"""What the connectors ask a store instead of its type: whether it lives in one process, how many uses
admit a page behind memory, and which memory tier (if any) sits in front of a slower one."""

from kvoffload import open_store
from kvoffload.store import parse_store_url


def test_every_spec_answers_the_capabilities(tmp_path):
    disk = tmp_path / "d"
    cases = {
        "memory://?capacity=1MiB": (True, 1, None),
        f"lmdb://{disk}?capacity=16MiB": (False, 1, None),
        "redis://localhost:6379/0?namespace=x": (False, 1, None),
        f"tiered://?memory=1MiB&lmdb={disk}&lmdb_capacity=16MiB&admit=2": (False, 2, "memory"),
    }
    for url, (local, admit, front) in cases.items():
        spec = parse_store_url(url)
        assert (spec.process_local, spec.admit) == (local, admit), url
        assert (spec.memory_front is not None and spec.memory_front.scheme) == (front or False), url


def test_only_a_memory_tier_in_front_is_a_memory_front(tmp_path):
    memory = open_store("memory://?capacity=1MiB&pinned=false")
    assert memory.process_local and memory.memory_front is None
    tiered = open_store(f"tiered://?memory=1MiB&lmdb={tmp_path / 't'}&lmdb_capacity=16MiB&pinned=false")
    assert not tiered.process_local and tiered.memory_front is tiered.front
    disk = open_store(f"lmdb://{tmp_path / 'l'}?capacity=16MiB")
    assert not disk.process_local and disk.memory_front is None
    for store in (memory, tiered, disk):
        store.close()
