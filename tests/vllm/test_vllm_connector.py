"""KVOffloadConnector in the real vLLM engine (CPU build): cold run, local prefix cache reset, warm run
served by the connector; across an engine restart; with faulty stores; behind `vllm serve`. Each engine
start costs ~30 s on 2 cores, so every test starts as few engines as it can."""

import os
import textwrap

import lmdb
import pytest

pytest.importorskip("vllm.distributed", reason="the connector tests need vLLM (installed by `make test`)")

from support import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPT_A = [(7 * i + 3) % 500 + 3 for i in range(80)]  # 2 full blocks + 16: hit 64
PROMPT_B = [(11 * i + 5) % 500 + 3 for i in range(100)]  # 3 full blocks + 4: hit 96
LONG = [(13 * i + 1) % 500 + 3 for i in range(300)]  # for the hybrid model's larger block


def connector(store: str, **extra) -> dict:
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": store, **extra}}


def store_url(tier: str, tmp_path) -> str:
    return {"memory": "memory://?capacity=512MiB", "memory-s3fifo": "memory://?capacity=512MiB&evict=s3fifo",
            "lmdb": f"lmdb://{tmp_path}/store?capacity=1GiB",
            # tiered: written through, so a warm round's lookups (the scheduler reads the disk tier; a
            # worker's memory tier is in another process) never race the write-behind thread, which a busy
            # 2-core machine can hold back past the reset (a miss, recomputed); write-behind itself is
            # tested in tests/store/test_write_behind.py and on the GPU engine.
            "tiered": f"tiered://?memory=128MiB&lmdb={tmp_path}/store&lmdb_capacity=1GiB&write=through"}[tier]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return vh.tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return vh.tiny_qwen3_next(str(tmp_path_factory.mktemp("tiny-qwen3-next")))


def _assert_served(cold, warm, expected_external=None):
    for c, w in zip(cold, warm):
        assert c["num_external_cached_tokens"] == 0 and c["num_cached_tokens"] == 0
        assert w["tokens"] == c["tokens"], "warm tokens differ from cold"
        assert w["num_local_cached_tokens"] == 0, "the local prefix cache was reset: hits must be the connector's"
        assert w["num_external_cached_tokens"] > 0
    if expected_external is not None:
        assert [w["num_external_cached_tokens"] for w in warm] == expected_external


@pytest.mark.parametrize("tier", ["memory", "memory-s3fifo", "lmdb", "tiered"])
def test_llama_cold_reset_warm(llama_dir, tmp_path, tier):
    cold, warm = vh.run_generations(llama_dir, connector(store_url(tier, tmp_path)), [[PROMPT_A, PROMPT_B]] * 2,
                                    dtype="float32", block_size=BLOCK)
    _assert_served(cold, warm, [64, 96])


@pytest.mark.parametrize("tier", ["memory", "lmdb", "tiered"])
def test_qwen3_next_hybrid_cold_reset_warm(qwen_dir, tmp_path, tier):
    """Mamba (gated delta net) state groups and attention pages restored together."""
    result = vh.run_generations(qwen_dir, connector(store_url(tier, tmp_path)), [[LONG, PROMPT_B]] * 2,
                                dtype="bfloat16", block_size=BLOCK)
    cold, warm = result
    _assert_served(cold[:1], warm[:1])
    assert warm[1]["tokens"] == cold[1]["tokens"]


def test_tiered_admission_writes_to_disk_on_the_second_use(llama_dir, tmp_path):
    """tiered:// admit=2: a saved page waits in the worker's memory tier for its second use. The repeated
    prompt is hit there (the scheduler mirrors that tier) with the cold run's tokens, and that hit admits
    its pages to LMDB; the prompt used once never reaches LMDB."""
    from kvoffload.store.lmdb_store import read_stats

    url = f"tiered://?memory=128MiB&lmdb={tmp_path}/store&lmdb_capacity=1GiB&admit=2"
    cold, warm = vh.run_generations(llama_dir, connector(url), [[PROMPT_A, PROMPT_B], [PROMPT_A]], dtype="float32",
                                    block_size=BLOCK)
    _assert_served(cold[:1], warm, [64])
    assert read_stats(f"{tmp_path}/store")["entries"] == 2  # PROMPT_A's 2 blocks, not PROMPT_B's 3


@pytest.mark.parametrize("model", ["llama", "qwen3_next"])
def test_lmdb_across_an_engine_restart(llama_dir, qwen_dir, tmp_path, model):
    directory, dtype, prompts = ((llama_dir, "float32", [PROMPT_A, PROMPT_B]) if model == "llama"
                                 else (qwen_dir, "bfloat16", [LONG]))
    cold, warm = vh.run_restart(directory, connector(store_url("lmdb", tmp_path)), [prompts] * 2,
                                dtype=dtype, block_size=BLOCK)
    _assert_served(cold, warm)


def _flip_every_stored_page(directory: str) -> int:
    env = lmdb.open(directory, readonly=True, lock=False, max_dbs=8)
    with env.begin() as txn:
        pages = [bytes(v) for _, v in txn.cursor(env.open_db(b"data", txn=txn, create=False))]
    env.close()
    path = os.path.join(directory, "data.mdb")
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        for page in pages:
            at = raw.find(page[:256])
            raw[at + len(page) // 2] ^= 0xFF
        f.seek(0)
        f.write(raw)
    return len(pages)


def test_corrupt_entries_are_recomputed(llama_dir, tmp_path):
    url = store_url("lmdb", tmp_path)
    (cold,) = vh.run_restart(llama_dir, connector(url), [[PROMPT_A, PROMPT_B]], dtype="float32", block_size=BLOCK)
    assert _flip_every_stored_page(f"{tmp_path}/store") > 0
    result = vh.run_restart(llama_dir, connector(url), [[PROMPT_A, PROMPT_B]], dtype="float32", block_size=BLOCK)
    (warm,) = result
    assert [w["tokens"] for w in warm] == [c["tokens"] for c in cold]
    assert result.log.count("vLLM recomputes its prefix") == 2  # checksums caught both prompts' pages


def test_failing_reads_are_recomputed(llama_dir, tmp_path):
    """Every read of the store raises inside the worker (injected through sitecustomize in every
    process of the engine): the loads fail, vLLM recomputes, the tokens stay the same."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("KVOFFLOAD_TEST_FAIL_READS"):
            from kvoffload.store import lmdb_store

            def read_many(self, keys, consume):
                raise OSError("injected read failure")

            lmdb_store.LMDBStore.read_many = read_many
    """))
    url = store_url("lmdb", tmp_path)
    (cold,) = vh.run_restart(llama_dir, connector(url), [[PROMPT_A, PROMPT_B]], dtype="float32", block_size=BLOCK)
    env = {"KVOFFLOAD_TEST_FAIL_READS": "1", "PYTHONPATH": os.pathsep.join(
        [str(hooks), vh.ROOT, vh.TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    result = vh.run_restart(llama_dir, connector(url), [[PROMPT_A, PROMPT_B]], dtype="float32", block_size=BLOCK,
                            extra_env=env)
    (warm,) = result
    assert [w["tokens"] for w in warm] == [c["tokens"] for c in cold]
    assert result.log.count("vLLM recomputes its prefix") == 2  # both loads were promised, failed, recomputed


def test_vllm_serve_with_the_flag(llama_dir, tmp_path):
    """`vllm serve --kv-transfer-config` naming the connector alone (the plugin registers it), bound to
    127.0.0.1: a completion, then the same long prompt after a local prefix-cache reset is served by
    the connector (vLLM's and kvoffload's Prometheus counters), and the server stops cleanly."""
    config = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"store": store_url("lmdb", tmp_path)}}
    args = vh.serve_args(dtype="float32", block_size=BLOCK, max_model_len=512, kv_transfer_config=config)
    with vh.vllm_serve(llama_dir, args, extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        first = vh.completion(url, PROMPT_B, max_tokens=8)["choices"][0]["token_ids"]
        vh._http(url + "/reset_prefix_cache", {})
        again = vh.completion(url, PROMPT_B, max_tokens=8)["choices"][0]["token_ids"]
        metrics = vh.scrape_metrics(url)
        proc = url.proc
    assert again == first and len(first) == 8
    assert vh.metric_sum(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 96
    assert vh.metric_sum(metrics, "vllm:kvoffload_loaded_pages_total") > 0
    assert proc.poll() is not None


@pytest.fixture
def redis_server(tmp_path):
    from kvoffload.tools.bench.redis_server import Server

    server = Server(str(tmp_path))
    yield server
    server.stop()


def test_shared_redis_tier_across_engine_processes(qwen_dir, redis_server):
    """Two engine processes (two serving instances) with their own memory tier in front of one Redis:
    the second serves the hybrid model's prefix, attention pages and mamba state, from Redis."""
    url = f"tiered://?memory=128MiB&redis=redis://{redis_server.address}/0"
    cold, warm = vh.run_restart(qwen_dir, connector(url), [[LONG]] * 2, dtype="bfloat16", block_size=BLOCK)
    _assert_served(cold, warm)


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    from kvoffload.tools.bench.s3_server import Server

    server = Server(str(tmp_path / "weed"))
    for name, value in server.env().items():  # the credentials, as the engine processes find them
        monkeypatch.setenv(name, value)
    yield server
    server.stop()


def test_a_fresh_engine_restores_a_prefix_only_the_bucket_holds(qwen_dir, s3_server):
    """The second engine process has an empty memory tier and no disk: the hybrid model's prefix,
    attention pages and mamba state come from the S3 bucket alone, tokens equal to the cold run."""
    from urllib.parse import quote

    s3 = quote(f"s3://{s3_server.bucket}/vllm?endpoint={s3_server.endpoint}&timeout=20", safe="")
    url = f"tiered://?memory=128MiB&s3={s3}"
    cold, warm = vh.run_restart(qwen_dir, connector(url), [[LONG]] * 2, dtype="bfloat16", block_size=BLOCK)
    _assert_served(cold, warm)


def test_a_fresh_engine_restores_a_prefix_only_the_mooncake_pool_holds(qwen_dir):
    """Both engine processes join a Mooncake pool as clients (segment=0) that a third process holds: the
    second one's memory tier is empty, the hybrid model's prefix comes from the pool, tokens equal."""
    import subprocess
    import sys
    from urllib.parse import quote

    from kvoffload.tools.bench.mooncake_server import Master

    with Master() as master:
        pool = subprocess.Popen([sys.executable, "-m", "kvoffload.tools.mooncake_pool", master.url(segment="512MiB")],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert pool.stdout.readline().startswith("contributing")
            url = f"tiered://?memory=128MiB&mooncake={quote(master.url(segment=0, namespace='vllm'), safe='')}"
            cold, warm = vh.run_restart(qwen_dir, connector(url), [[LONG]] * 2, dtype="bfloat16", block_size=BLOCK)
        finally:
            pool.terminate()
            pool.wait()
    _assert_served(cold, warm)


def test_store_is_never_read_under_another_conv_state_layout(qwen_dir, tmp_path):
    """vLLM's mamba conv-state layout (VLLM_SSM_CONV_STATE_LAYOUT: SD = (state_len, dim), DS = (dim,
    state_len)) keeps every page size: a store written by an SD engine must give a DS engine no hits
    (its recurrent state would be restored garbled), while the DS engine's own pages still hit."""
    url = f"lmdb://{tmp_path}/store?capacity=64MiB"
    (sd,) = vh.run_restart(qwen_dir, connector(url), [[LONG]], dtype="bfloat16", block_size=BLOCK,
                           extra_env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"})
    assert sd[0]["num_external_cached_tokens"] == 0
    cold, warm = vh.run_generations(qwen_dir, connector(url), [[LONG]] * 2, dtype="bfloat16", block_size=BLOCK,
                                    extra_env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"})
    assert cold[0]["num_external_cached_tokens"] == 0, "pages written under SD served to a DS engine"
    assert cold[0]["num_cached_tokens"] == 0
    _assert_served(cold, warm)  # DS -> DS still hits, with the cold run's tokens


@pytest.mark.parametrize("unit", [16, 32])
def test_qwen3_next_finer_prefix_match_unit(qwen_dir, tmp_path, unit):
    """vLLM's `prefix_match_unit` finer than the hybrid's physical block (64 tokens): pages and keys
    follow the physical block, hits are whole blocks; cold, then warm after a local reset and after
    a restart, on LMDB."""
    url = store_url("lmdb", tmp_path)
    kwargs = {"prefix_match_unit": unit}
    cold, warm = vh.run_generations(qwen_dir, connector(url), [[LONG]] * 2, dtype="bfloat16", block_size=BLOCK,
                                    engine_kwargs=kwargs)
    _assert_served([cold[0]], [warm[0]])
    (restarted,) = vh.run_restart(qwen_dir, connector(url), [[LONG]], dtype="bfloat16", block_size=BLOCK,
                                  engine_kwargs=kwargs)
    _assert_served([cold[0]], [restarted[0]])
    assert warm[0]["num_external_cached_tokens"] % 64 == 0


def test_qwen3_next_state_retention_hits_at_a_kept_boundary(qwen_dir, tmp_path):
    """vLLM hands off the gated-delta-net state at every 64-token boundary (a retention interval of one
    block, and a 64-token step budget: align mode materialises a state only where a prefill chunk ends,
    so each block is its own chunk); the connector saves those `state_retention` keeps: under 'last+exp' LONG (300 tokens, its
    longest hit 4 blocks) keeps boundaries 1, 2 and 4, not 3. A prompt sharing LONG's first 3 blocks
    then hits exactly 2 blocks (128 tokens; every boundary kept would give 192), with the tokens of its
    own cold run (round 0, under another cache salt: other keys, nothing to hit)."""
    shared = LONG[:192] + [(17 * i + 2) % 500 + 3 for i in range(100)]
    config = connector(store_url("lmdb", tmp_path), state_retention="last+exp")
    reference, long, warm = (r[0] for r in vh.run_generations(
        qwen_dir, config, [[{"tokens": shared, "cache_salt": "cold"}], [LONG], [shared]], dtype="bfloat16",
        block_size=BLOCK, engine_kwargs={"prefix_cache_retention_interval": 64, "max_num_batched_tokens": 64}))
    assert reference["num_cached_tokens"] == 0 and long["num_cached_tokens"] == 0
    assert warm["num_local_cached_tokens"] == 0 and warm["num_external_cached_tokens"] == 128
    assert warm["tokens"] == reference["tokens"]


@pytest.mark.parametrize("tier", ["memory", "lmdb", "tiered"])
def test_reset_connector_clears_the_store(llama_dir, tmp_path, tier):
    """`llm.reset_prefix_cache(reset_connector=True)` after the cold round: it reports success and the
    next round gets nothing from the connector (same tokens, recomputed); that round saves its pages
    again, and after a plain local reset the third round is served from the store (so the worker's
    own copy was cleared too: pages it still held would not have been saved and reported again)."""
    # tiered is written through (store_url): clearing values still queued behind is tested in
    # test_store_roundtrip.
    url = store_url(tier, tmp_path)
    cold, cleared, warm = vh.run_generations(llama_dir, connector(url), [[PROMPT_A, PROMPT_B]] * 3,
                                             dtype="float32", block_size=BLOCK,
                                             reset_connector=[True, False])  # the harness raises on False
    for c, w in zip(cold, cleared):
        assert w["tokens"] == c["tokens"]
        assert w["num_external_cached_tokens"] == 0 and w["num_local_cached_tokens"] == 0
    _assert_served(cold, warm, [64, 96])


def test_a_store_smaller_than_a_page_is_a_warning_not_an_error_per_save(llama_dir):
    """A capacity below one page: one WARNING at start-up, the engine serves, saves skip quietly."""
    result = vh.run_generations(llama_dir, connector("memory://?capacity=1KiB"), [[PROMPT_A, PROMPT_B]] * 2,
                                dtype="float32", block_size=BLOCK)
    cold, warm = result
    assert [w["tokens"] for w in warm] == [c["tokens"] for c in cold]
    assert all(w["num_external_cached_tokens"] == 0 for w in warm)
    assert result.log.count("raise its capacity") == 1
    assert "save failed" not in result.log
    assert not [line for line in result.log.splitlines() if "ERROR" in line and "kvoffload" in line.lower()]


def _tiny_lora(model_dir, out_dir, rank: int = 8, seed: int = 1) -> str:
    """A PEFT-format LoRA adapter on the tiny llama's k_proj and v_proj (so it changes the KV itself),
    with random A and B (PEFT starts B at zero: that adapter would change nothing)."""
    import json

    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv, rank, generator=gen) * 0.2
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["k_proj", "v_proj"],
                   "bias": "none", "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM"}, f)
    return str(out_dir)


def test_a_crafted_cache_salt_never_loads_another_requests_kv(llama_dir, tmp_path):
    """Cache poisoning through cache_salt: a base-model request whose client-chosen salt spells what an
    unframed salt of a LoRA request would be ('|lora:<name>') must not write pages the LoRA request then
    loads. The LoRA request gets nothing from the connector and emits its own cold tokens."""
    adapter = _tiny_lora(llama_dir, str(tmp_path / "adapter-x"))
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    crafted = {"tokens": LONG, "cache_salt": f"|lora:{os.path.basename(adapter)}"}
    victim = {"tokens": LONG, "lora": adapter}
    (own_cold,) = vh.run_restart(llama_dir, None, [[victim]], dtype="float32", block_size=BLOCK, engine_kwargs=lora)
    base, attacked, again = vh.run_generations(
        llama_dir, connector(store_url("lmdb", tmp_path)), [[crafted], [victim], [crafted]], dtype="float32",
        block_size=BLOCK, engine_kwargs=lora)
    assert base[0]["num_external_cached_tokens"] == 0
    assert attacked[0]["num_external_cached_tokens"] == 0, "the LoRA request loaded the crafted request's KV"
    assert attacked[0]["tokens"] == own_cold[0]["tokens"]
    assert own_cold[0]["tokens"] != base[0]["tokens"], "the adapter must change the output for this test to bite"
    assert again[0]["num_external_cached_tokens"] > 0 and again[0]["tokens"] == base[0]["tokens"]  # its own: hit


def test_kv_events_reach_vllms_zmq_publisher(llama_dir, tmp_path):
    """`--kv-events-config` (publisher zmq): after a cold run on LMDB, a subscriber reading vLLM's msgpack
    batches sees one BlockStored per full prompt block with medium STORAGE, vLLM's own hashes (those of
    its GPU events for the same tokens), chained by parent; the warm run's hits announce nothing again."""
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    port = vh.free_port()
    batches, stop = [], threading.Event()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    gone = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # the publisher's socket closed (the engine exited)

    def read():  # (topic, seq, msgpack KVEventBatch) per publish, until `stop` and nothing is left to read
        while True:
            last = stop.is_set()  # set only once every batch is queued here: a poll after it finds them all
            if sub.poll(100):
                batches.append(decoder.decode(sub.recv_multipart()[2]))
            elif last:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        cold, warm = vh.run_generations(
            llama_dir, connector(store_url("lmdb", tmp_path)), [[PROMPT_A, PROMPT_B]] * 2, dtype="float32",
            block_size=BLOCK, engine_kwargs={"kv_events_config": {
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}})
        # The engine has exited: the disconnect comes after the last batch on the same TCP stream, so once
        # it is seen every batch is queued in `sub`; the reader drains them and stops (no sleep).
        assert gone.poll(60_000), "the engine's publisher never disconnected"
    finally:
        stop.set()
        reader.join(60)
        assert not reader.is_alive(), "the subscriber thread is stuck"
        sub.disable_monitor()
        gone.close(0)
        sub.close(0)
        context.term()
    _assert_served(cold, warm, [64, 96])
    events = [event for batch in batches for event in batch.events]
    ours = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    blocks = [PROMPT_A[i * BLOCK:(i + 1) * BLOCK] for i in range(2)] + [PROMPT_B[i * BLOCK:(i + 1) * BLOCK]
                                                                      for i in range(3)]
    assert [e.token_ids for e in ours] == blocks  # once each: the warm run's hits add nothing
    assert all(e.block_size == BLOCK and len(e.block_hashes) == 1 and e.lora_id is None and e.group_idx == 0
               for e in ours)
    for chain in (ours[:2], ours[2:]):
        assert chain[0].parent_block_hash is None
        assert [e.parent_block_hash for e in chain[1:]] == [e.block_hashes[0] for e in chain[:-1]]
    gpu = {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert {e.block_hashes[0] for e in ours} <= gpu, "the connector's hashes are not vLLM's"
    assert not [e for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_queued_requests_prefix_is_prefetched_from_disk(qwen_dir, tmp_path, prefetch):
    """tiered:// after a restart (memory empty, the prefix on LMDB only), one request at a time: the
    prompt added while another runs waits in vLLM's queue, and its prefix is promoted into memory
    meanwhile, so its load reads memory, not disk; tokens equal the cold run's. prefetch_bytes=0: none."""
    from kvoffload.tools.harness.vllm_engine import Engine

    url = store_url("tiered", tmp_path)
    config = connector(url, **({} if prefetch else {"prefetch_bytes": "0"}))
    with Engine(qwen_dir, config, block_size=BLOCK, max_model_len=1024, dtype="bfloat16",
                engine_kwargs={"disable_log_stats": False}) as first:
        cold = first.call("generate", prompts=[LONG], max_tokens=6)["rows"][0]
    with Engine(qwen_dir, config, block_size=BLOCK, max_model_len=1024, dtype="bfloat16", in_process=True,
                engine_kwargs={"max_num_seqs": 1}) as second:
        out = second.call("queued", first=PROMPT_B, first_max_tokens=64, prompt=LONG, max_tokens=6, store=url)
    assert out["tokens"] == cold["tokens"]
    assert out["num_cached_tokens"] > 0, "the restarted engine's hit can only be the connector's"
    store = out["store"]
    if prefetch:
        assert store["prefetched"] > 0 and store["memory_hits"] > 0
    else:  # the load itself found memory empty and promoted what it read from disk
        assert store["prefetched"] == 0 and store["memory_hits"] == 0 and store["promotions"] > 0


def test_kv_offloading_size_beside_our_connector_names_the_option_to_drop(llama_dir):
    """vLLM's `--kv-offloading-size` wins over `--kv-transfer-config` (it swaps in its own connector and
    keeps our module path); asking our module for vLLM's class then says which of the two to drop."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with pytest.raises(AttributeError) as raised:
        config = VllmConfig(model_config=ModelConfig(llama_dir, dtype="float32", skip_tokenizer_init=True),
                            cache_config=CacheConfig(kv_offloading_size=1.0),
                            kv_transfer_config=KVTransferConfig(**connector("memory://?capacity=64MiB")))
        assert config.kv_transfer_config.kv_connector in ("OffloadingConnector", "SimpleCPUOffloadConnector")
        KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    chain = [raised.value, raised.value.__cause__]
    assert any("use --kv-transfer-config alone for kvoffload, or --kv-offloading-size alone" in str(e) for e in chain)
