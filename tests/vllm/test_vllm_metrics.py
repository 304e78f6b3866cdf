"""The connector's numbers in vLLM's metrics line: rates from the byte and time counters of both ways."""

import pytest

pytest.importorskip("vllm.distributed", reason="the metrics classes subclass vLLM's")

from kvoffload.connectors.vllm_metrics import KVOffloadStats  # noqa: E402


def test_reduce_reports_both_directions_rates_from_their_counters():
    stats = KVOffloadStats(data={"loaded_bytes": 4_000_000, "load_microseconds": 1_000,
                                 "saved_bytes": 6_000_000, "save_microseconds": 2_000, "saved_pages": 3})
    out = stats.aggregate(KVOffloadStats(data={"saved_bytes": 2_000_000})).reduce()
    assert out["load_GBps"] == 4.0 and out["save_GBps"] == 4.0  # 8 MB in 2 ms
    assert out["saved_pages"] == 3 and out["saved_bytes"] == 8_000_000
    assert "save_GBps" not in KVOffloadStats(data={"saved_bytes": 1}).reduce()  # no time: no rate
