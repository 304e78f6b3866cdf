"""`bench overhead`'s arithmetic (no engine): hook time counts a hook called from another hook once."""

import itertools
import sys
import time

from kvoffload.bench.vllm_engine import _time_connector_hooks


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
    total = _time_connector_hooks({"kv_connector_module_path": "nested_connector", "kv_connector": "C"})
    connector = sys.modules["nested_connector"].C()
    assert connector.request_finished_all_groups(None, []) == (False, None)
    assert total == [3.0]  # outer: readings 0 and 3 (the inner call read 1 and 2)
    connector.request_finished(None, [])
    assert total == [4.0]
