"""`bench overhead`'s arithmetic (no engine): hook time counts a hook called from another hook once,
and step times against no connector are paired per batch."""

import itertools
import sys
import time

from kvoffload.tools.bench.overhead import summarize
from kvoffload.tools.harness.vllm_child import _time_connector_hooks


def test_a_hook_inside_a_hook_is_timed_once(tmp_path, monkeypatch):
    (tmp_path / "nested_connector.py").write_text(
        "class C:\n"
        "    def request_finished(self, request, block_ids):\n"
        "        return False, None\n"
        "    def request_finished_all_groups(self, request, block_ids):\n"
        "        return self.request_finished(request, block_ids)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    clock = itertools.count()  # every reading one second later
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    spent = _time_connector_hooks({"kv_connector_module_path": "nested_connector", "kv_connector": "C"})
    connector = sys.modules["nested_connector"].C()
    assert connector.request_finished_all_groups(None, []) == (False, None)
    # outer: readings 0 and 3 (the inner call read 1 and 2), counted once, under the outer hook's name
    assert spent == {"total": 3.0, "request_finished_all_groups": 3.0}
    connector.request_finished(None, [])
    assert spent == {"total": 4.0, "request_finished_all_groups": 3.0, "request_finished": 1.0}


def _rows(seconds: list[float], **extra) -> list[dict]:
    return [{"seconds": s, "thread_cpu_seconds": s / 2, "process_cpu_seconds": s, "steps": 10,
             "connector_seconds": extra.get("hooks", 0.0), "cached_tokens": 0} for s in seconds]


def test_step_times_are_compared_per_batch():
    # Batch 1 of the memory engine ran in a slow spell; paired, it is one outlier among three ratios.
    rows = {"none": _rows([1.0, 1.0, 2.0]), "noop_connector": _rows([1.0, 1.0, 2.0]),
            "kvoffload_memory": _rows([1.1, 2.2, 2.2], hooks=0.01),
            "kvoffload_lmdb": _rows([1.0, 1.0, 2.0], hooks=0.02), "kvoffload_tiered": _rows([0.9, 0.9, 1.8])}
    out = summarize(rows)
    assert out["results"]["none"] == {"step_ms": 100.0, "step_cpu_ms": 50.0, "step_process_cpu_ms": 100.0,
                                      "batch_ms": 1000.0, "steps_per_batch": 10, "connector_ms_per_step": 0.0}
    assert out["per_batch"]["kvoffload_memory"]["step_ms"] == [110.0, 220.0, 220.0]
    assert out["overhead_percent"]["kvoffload_memory"] == 10.0  # ratios 1.1, 2.2, 1.1
    assert out["overhead_unpaired_percent"]["kvoffload_memory"] == 120.0  # median 220 ms vs 100 ms
    assert out["overhead_cpu_percent"]["kvoffload_memory"] == 10.0
    assert out["overhead_percent"]["kvoffload_tiered"] == -10.0 and out["overhead_percent"]["kvoffload_lmdb"] == 0
    assert out["overhead_beyond_vllm_hooks_percent"]["kvoffload_memory"] == 10.0
    assert out["connector_hooks_percent_of_step"] == {"kvoffload_memory": 1.0, "kvoffload_lmdb": 2.0,
                                                      "kvoffload_tiered": 0.0}
