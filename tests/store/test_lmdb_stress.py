"""LMDB under threads x processes with a watchdog (`kvoffload.tools.bench.faults.concurrency`): two processes
each run two writer and two reader threads putting 0.25-3 MiB values into a store far smaller than what
they write (evictions in every transaction, batches split, free pages scattered), while a third keeps
opening the store with another capacity, writing, reading and closing it. The watchdog fails the test
when no process makes progress for 40 s (with every child's thread stacks): a lock-order deadlock or a
hang fails here instead of hanging `make test`. Every value read anywhere is checked byte for byte, and
a reopen afterwards checks every entry and the byte accounting."""

from __future__ import annotations

import pytest

from kvoffload import open_store
from kvoffload.tools.bench import faults
from kvoffload.store.lmdb_store import entry_charge

CAPACITY = 48 << 20
BAD = ("checksum_failures", "bad_header", "length_mismatch", "version_mismatch", "fingerprint_mismatch",
       "read_errors", "damaged_files_reset")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_threads_and_processes_with_evictions_and_reopens_never_stall(tmp_path):
    try:
        reports = faults.concurrency(str(tmp_path), seconds=12, capacity=CAPACITY)
    except faults.Stall as exc:
        pytest.fail(f"stall: {exc}")
    assert [r["errors"] for r in reports] == [[]] * len(reports)
    for r in reports:
        assert all(r["stats"].get(name, 0) == 0 for name in BAD), r["stats"]
    assert all(r["ops"] > 20 for r in reports[:-1]), [r["ops"] for r in reports]
    assert sum(r["stats"]["evictions"] for r in reports[:-1]) > 0  # far more was written than fits
    assert reports[-1]["ops"] >= 3  # the reopening process got in between, several times

    # Reopened alone: every entry is its key's value, the accounting is exactly what is there.
    with open_store(f"lmdb://{tmp_path}/store?capacity={CAPACITY}") as store:
        present = {}
        for r in reports:
            for k in set(r["acked"]):
                value = store.get(k.encode())
                if value is not None:
                    assert value == faults.value_of(k.encode()), k
                    present[k] = len(value)
        stats = store.stats()
    assert present, "nothing acknowledged survived"
    assert stats["entries"] == len(present), stats
    assert stats["bytes_used"] == sum(entry_charge(n) for n in present.values()) <= CAPACITY
