"""The vLLM test harness (tests/support/vllm_harness.py) against the real CPU engine, with vLLM's built-in
ExampleConnector (safetensors files) standing in for a KV connector.  Each engine start is ~30 s on
2 cores, so every test starts as few engines as it can."""

import socket

import pytest

pytest.importorskip("vllm.distributed", reason="the vLLM harness tests need vLLM (installed by `make test`)")

from support import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 32
# ExampleConnector stores / matches floor((len - 1) / BLOCK) * BLOCK tokens: 64 for A, 96 for C.
PROMPT_A = [(7 * i + 3) % 500 + 3 for i in range(80)]
PROMPT_B = [(11 * i + 5) % 500 + 3 for i in range(70)]
PROMPT_C = [(13 * i + 1) % 500 + 3 for i in range(100)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return vh.tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def example_connector(path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def test_example_connector_cold_reset_warm(llama_dir, tmp_path):
    """One engine: cold round, reset_prefix_cache, warm round served by the connector."""
    store = tmp_path / "store"
    result = vh.run_generations(
        llama_dir, example_connector(store), [[PROMPT_A, PROMPT_B], [PROMPT_A, PROMPT_C]],
        dtype="float32", block_size=BLOCK,
    )
    cold, warm = result
    assert any(store.iterdir()), "ExampleConnector saved nothing"
    for r in cold:
        assert r["num_cached_tokens"] == 0 and r["num_external_cached_tokens"] == 0
        assert len(r["tokens"]) == 8
    a_warm, c_new = warm
    assert a_warm["tokens"] == cold[0]["tokens"]
    # The local prefix cache was reset: every cached token of A came through the connector.
    assert a_warm["num_local_cached_tokens"] == 0
    assert a_warm["num_external_cached_tokens"] == 64 == a_warm["num_cached_tokens"]
    assert a_warm["num_computed_tokens"] == len(PROMPT_A) - 64
    # C was never stored: the counter is per request, not per round.
    assert c_new["num_external_cached_tokens"] == 0 and c_new["num_cached_tokens"] == 0
    # vLLM's own Prometheus counters agree with the per-request counter.
    cold_m, warm_m = result.metrics
    assert cold_m["prompt_tokens_by_source{source=external_kv_transfer}"] == 0
    assert warm_m["prompt_tokens_by_source{source=external_kv_transfer}"] == 64
    assert warm_m["external_prefix_cache_hits"] == 64
    assert warm_m["prefix_cache_hits"] == 0


def test_example_connector_restart(llama_dir, tmp_path):
    """Cold in one engine process, warm in a new one: only the connector's files carry over."""
    cold, warm = vh.run_restart(
        llama_dir, example_connector(tmp_path / "store"), [[PROMPT_C], [PROMPT_C]],
        dtype="float32", block_size=BLOCK,
    )
    assert cold[0]["num_external_cached_tokens"] == 0
    assert warm[0]["tokens"] == cold[0]["tokens"]
    assert warm[0]["num_external_cached_tokens"] == 96 == warm[0]["num_cached_tokens"]
    assert warm[0]["num_local_cached_tokens"] == 0


def test_vllm_serve_token_id_prompt(llama_dir):
    """`vllm serve` (CPU build via the "+cpu" wrapper): token-id prompts, no tokenizer; stopped on exit."""
    args = vh.serve_args(dtype="float32", block_size=BLOCK, max_model_len=512)
    with vh.vllm_serve(llama_dir, args) as url:
        port = int(url.rsplit(":", 1)[1])
        first = vh.completion(url, PROMPT_A, max_tokens=8)
        ids = first["choices"][0]["token_ids"]
        assert len(ids) == 8 and all(0 <= t < 512 for t in ids)
        assert first["choices"][0]["prompt_token_ids"] == PROMPT_A
        again = vh.completion(url, PROMPT_A, max_tokens=8)
        assert again["choices"][0]["token_ids"] == ids
        m = vh.scrape_metrics(url)
        assert vh.metric_sum(m, "vllm:prefix_cache_hits_total") >= 64  # second request hit locally
        proc = url.proc
    assert proc.poll() is not None, "server still running after the context exited"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "port still accepting connections"


def test_qwen3_next_hybrid_generates(tmp_path):
    """Tiny Qwen3-Next (gated-delta-net + full attention + MoE, bf16) runs on the CPU engine,
    deterministically, and its prefix cache hits (vLLM aligns the attention block to 64 here)."""
    model = vh.tiny_qwen3_next(str(tmp_path / "tiny-qwen3-next"))
    long_prompt = [(7 * i + 3) % 500 + 3 for i in range(200)]
    first, second = vh.run_generations(
        model, None, [[long_prompt, PROMPT_B], [long_prompt, PROMPT_B]],
        dtype="bfloat16", block_size=BLOCK, reset_between_rounds=False,
    )
    for a, b in zip(first, second):
        assert len(a["tokens"]) == 8 and a["tokens"] == b["tokens"]
        assert a["num_cached_tokens"] == 0
    assert second[0]["num_local_cached_tokens"] > 0
    assert second[0]["num_external_cached_tokens"] == 0


_HEALTHY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_serve_start_that_lost_its_port_is_retried_on_a_new_one(monkeypatch, tmp_path):
    """A port the harness picks can be taken before the server binds it: that start is stopped and
    retried on a new port; a port the caller named is not retried (its error says why). The server is
    a stand-in that binds the port and answers /health, so no engine starts."""
    import subprocess
    import sys

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy, vh.free_port()])
    monkeypatch.setattr(vh, "free_port", lambda: next(ports))
    started = []

    def stand_in(model_dir, args, port, extra_env, log_path):
        started.append(port)
        base = vh._Server(f"http://127.0.0.1:{port}")
        base.log_path = log_path
        with open(log_path, "wb") as log:
            base.proc = subprocess.Popen([sys.executable, "-c", _HEALTHY_SERVER, str(port)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return base

    monkeypatch.setattr(vh, "_start_serve", stand_in)
    try:
        with vh.vllm_serve(str(tmp_path), [], startup_timeout=30) as url:
            assert vh._http(url + "/health") == b"ok" and not url.endswith(f":{busy}")
            server = url.proc
        assert started[0] == busy and len(started) == 2 and server.poll() is not None  # stopped on exit
        with pytest.raises(vh.HarnessError, match="Address already in use"):
            with vh.vllm_serve(str(tmp_path), [], port=busy, startup_timeout=30):
                pass
        assert started[2:] == [busy]
    finally:
        taken.close()
