"""KVOffloadConnector in the real vLLM GPU engine (vLLM 0.33 and 0.34 CUDA wheels): a llama-shaped model, a hybrid
qwen3next model and GLM-5.3-Flash (`glm5next`, a random 4-layer checkpoint with the full model's MLA,
indexer and KDA widths). Skipped without CUDA and vLLM: it runs on a GPU machine, never in CI
(`pytest -m vllm_gpu tests/vllm/test_vllm_gpu.py`, about 12 minutes; one xdist group per model). Side by side
(`-n 3 --dist loadgroup`) an engine's start may fail in vLLM's memory profiling, which asserts when another process
frees GPU memory meanwhile: run the llama-shaped set (vLLM's own memory sizing) alone (`-k llama`).

Each model's engines run once, in a module fixture, and the tests read what they recorded:
- memory://: cold, the same prompt from vLLM's own prefix cache, then after a reset from the connector
  (tokens equal, hits the connector's); prompts sharing that prefix, concurrently; requests aborted while
  their loads and saves are in flight; every restored page compared byte for byte with the store
  (`page_audit`) and the kpool tail never stored;
- lmdb://: cold references, then a new engine process warm from disk; every stored page corrupted, then
  another process recomputes; (llama) every read failing, then another process recomputes;
- tiered://: a warm run from the memory tier; (llama, qwen3next) a KV cache small enough that concurrent
  requests are preempted while the connector loads and saves.
The engine's start-up check of the real CUDA tensors against the layout (`check_tensors`) runs in every
engine. Greedy tokens are compared in the same batch shapes where near-ties could flip them (random
weights): cold and warm runs are one prompt per `generate`."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the GPU engine tests need CUDA", allow_module_level=True)
pytest.importorskip("vllm.distributed", reason="the GPU engine tests need vLLM's CUDA build")

from support import vllm_harness as vh  # noqa: E402
from test_vllm_connector import _flip_every_stored_page, connector  # noqa: E402

from kvoffload.tools.harness.vllm_engine import Engine  # noqa: E402

pytestmark = [pytest.mark.vllm_gpu, pytest.mark.slow]
MAX_TOKENS = 8
GPU = {"gpu_memory_utilization": 0.05, "disable_log_stats": False}


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class Model:
    """A model directory and how to run it on the GPU."""

    def __init__(self, name, directory, *, block_size, prompt_tokens, vocab, kv_bytes, extra=None,
                 preempt_blocks=None, fail_reads=False):
        self.name, self.directory, self.block_size, self.vocab = name, directory, block_size, vocab
        self.prompt_tokens, self.kv_bytes, self.extra = prompt_tokens, kv_bytes, dict(extra or {})
        self.preempt_blocks, self.fail_reads = preempt_blocks, fail_reads
        self.max_model_len = prompt_tokens + 256

    def engine(self, store_url, *, kv_bytes=None, extra_env=None, **kwargs) -> Engine:
        engine_kwargs = {**GPU, "kv_cache_memory_bytes": kv_bytes or self.kv_bytes, **self.extra, **kwargs}
        return Engine(self.directory, connector(store_url), block_size=self.block_size, dtype="bfloat16",
                      max_model_len=self.max_model_len, in_process=True, audit=True, warmup=False,
                      engine_kwargs=engine_kwargs, extra_env=vh._engine_env(extra_env), timeout=900)

    def prompt(self, seed: int, n: int | None = None) -> list[int]:
        return _tokens(seed, n or self.prompt_tokens, self.vocab)


def _build(name: str, root) -> Model:
    if name == "llama":
        d = vh.tiny_llama(str(root / "llama"), hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64)
        return Model(name, d, block_size=16, prompt_tokens=300, vocab=512, kv_bytes=1 << 30,
                     extra={"max_num_batched_tokens": 128}, preempt_blocks=60, fail_reads=True)
    if name == "qwen3_next":
        d = vh.tiny_qwen3_next(str(root / "qwen3next"), max_position_embeddings=8192)
        return Model(name, d, block_size=None, prompt_tokens=3000, vocab=512, kv_bytes=2 << 30,
                     extra={"gdn_prefill_backend": "triton"})
    from glm_integration.checkpoint import write_checkpoint
    from glm_integration.config import preset

    config = preset("vllm-4l")
    d = str(root / "glm")
    write_checkpoint(config, 0, d, format="vllm")
    return Model(name, d, block_size=None, prompt_tokens=2 * 4352 + 300, vocab=config.vocab_size,
                 kv_bytes=8 << 30, extra={"max_num_batched_tokens": 4352})


def _generate(engine: Engine, prompts, max_tokens: int = MAX_TOKENS) -> list[dict]:
    return engine.call("generate", prompts=prompts, max_tokens=max_tokens)["rows"]


def _reset(engine: Engine, reset_connector: bool = False) -> None:
    assert engine.call("reset", reset_connector=reset_connector)["ok"], "the prefix cache could not be reset"


def _runs(model: Model, tmp) -> dict:
    """Every engine of one model, in order; what each step saw."""
    p1, p2 = model.prompt(1), model.prompt(2)
    # P1 but for the last token: P1's blocks and its last KDA/GDN checkpoint (a hybrid model's state is
    # stored where the prefill ended, so a prompt leaving P1 earlier would find no checkpoint to end on)
    shared = [p1[:-1] + [3 + (p1[-1] + 1 + i) % (model.vocab - 3)] for i in range(3)]
    out: dict = {"model": model.name}
    lmdb = f"lmdb://{tmp}/lmdb?capacity=2GiB"
    with model.engine(lmdb) as engine:  # cold references, one prompt (and its own store) at a time
        for i, prompt in enumerate(shared):
            out[f"shared_cold_{i}"] = _generate(engine, [prompt])[0]
            _reset(engine, reset_connector=True)
        out["cold_p1"] = _generate(engine, [p1])[0]
        out["cold_p2"] = _generate(engine, [p2])[0]
        out["lmdb_save_audit"] = engine.call("audit")
    with model.engine(lmdb) as engine:  # a new engine process, warm from disk
        out["restart_p1"] = _generate(engine, [p1])[0]
        out["restart_audit"] = engine.call("audit")
    out["corrupted_pages"] = _flip_every_stored_page(f"{tmp}/lmdb")
    with model.engine(lmdb) as engine:
        out["corrupt_p2"] = _generate(engine, [p2])[0]
        out["corrupt_log"] = engine.log_text().count("vLLM recomputes its prefix")
    if model.fail_reads:
        hooks = tmp / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
            from kvoffload.store import lmdb_store

            def read_many(self, keys, consume):
                raise OSError("injected read failure")

            lmdb_store.LMDBStore.read_many = read_many
        """))
        env = {"PYTHONPATH": os.pathsep.join([str(hooks), vh.child_env()["PYTHONPATH"]])}
        with model.engine(lmdb, extra_env=env) as engine:  # P1's (damaged) entries are listed: its load fails
            out["failing_p1"] = _generate(engine, [p1])[0]
            out["failing_log"] = engine.log_text().count("vLLM recomputes its prefix")

    with model.engine("memory://?capacity=2GiB") as engine:
        out["memory_cold_p1"] = _generate(engine, [p1])[0]
        out["local_p1"] = _generate(engine, [p1])[0]  # vLLM's own prefix cache
        _reset(engine)
        out["memory_p1"] = _generate(engine, [p1])[0]  # only the connector can serve it now
        _reset(engine)
        out["shared_warm"] = _generate(engine, shared)  # concurrently, P1's prefix from the connector
        out["abort"] = engine.call("abort", prompts=[p1, model.prompt(3)], steps=2)
        _reset(engine)
        out["after_abort_p1"] = _generate(engine, [p1])[0]
        out["memory_audit"] = engine.call("audit")
        out["memory_log"] = engine.log_text()

    if model.name == "llama":  # sized by vLLM's own memory profiling: vLLM 0.34's extensible KV cache
        with model.engine("memory://?capacity=1GiB", kv_cache_memory_bytes=None, gpu_memory_utilization=0.1) as engine:
            out["extensible_cold_p1"] = _generate(engine, [p1])[0]
            _reset(engine)
            out["extensible_p1"] = _generate(engine, [p1])[0]
            out["extensible_audit"] = engine.call("audit")
            out["extensible_segments"] = "one segment per layer" in engine.log_text()

    tiered = f"tiered://?memory=2GiB&lmdb={tmp}/tiered&lmdb_capacity=2GiB"
    small = {"num_gpu_blocks_override": model.preempt_blocks} if model.preempt_blocks else {}
    with model.engine(tiered, **small) as engine:
        out["tiered_cold_p1"] = _generate(engine, [p1])[0]
        _reset(engine)
        out["tiered_p1"] = _generate(engine, [p1])[0]
        if small:
            others = [model.prompt(20 + i) for i in range(3)]
            out["preempt_alone"] = [_generate(engine, [p], max_tokens=48)[0] for p in others]
            _reset(engine)
            batch = engine.call("generate", prompts=[p1, *others], max_tokens=48)
            out["preempt_batch"], out["preempt_metrics"] = batch["rows"], batch["metrics"]
        out["tiered_audit"] = engine.call("audit")
    return out


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.xdist_group(name))
                                        for name in ("llama", "qwen3_next", "glm5next")])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return _runs(_build(request.param, tmp), tmp)


def _served(row: dict) -> int:
    assert row["num_local_cached_tokens"] == 0, "the local prefix cache was reset: hits must be the connector's"
    return row["num_external_cached_tokens"]


def test_cold_then_warm_from_memory_equals_cold_and_vllms_own_cache(runs):
    cold, local, warm = runs["memory_cold_p1"], runs["local_p1"], runs["memory_p1"]
    assert cold["num_cached_tokens"] == 0 and local["num_local_cached_tokens"] > 0 and _served(warm) > 0
    if runs["model"] == "llama":  # one block size, one hit rule
        assert _served(warm) == local["num_local_cached_tokens"], "the connector serves what vLLM's cache did"
    assert warm["tokens"] == local["tokens"] == cold["tokens"] == runs["cold_p1"]["tokens"]
    print(json.dumps({"model": runs["model"], "prompt_tokens": cold["num_prompt_tokens"],
                      "connector_tokens": warm["num_external_cached_tokens"],
                      "local_tokens": local["num_local_cached_tokens"]}))


def test_every_restored_page_equals_the_stored_one(runs):
    for name in ("memory_audit", "restart_audit", "tiered_audit"):
        audit = runs[name]
        loaded = sum(audit["loaded_pages"].values())
        assert loaded > 0 and audit["mismatches"] == [] and audit["equal_to_store"] == loaded, name
    audit = runs["memory_audit"]
    assert audit["equal_to_saved"] == sum(audit["loaded_pages"].values())  # saved and restored in one process
    kinds = {g["name"]: g["kind"] for g in audit["groups"]}
    assert {kinds[name] for name in audit["loaded_pages"]} == {k for k in kinds.values() if k != "skip"}
    assert not any(kinds[name] == "skip" for name in runs["lmdb_save_audit"]["saved_pages"])


def test_a_new_engine_process_is_warm_from_lmdb(runs):
    warm = runs["restart_p1"]
    assert _served(warm) > 0 and warm["tokens"] == runs["cold_p1"]["tokens"]


def test_prompts_sharing_a_prefix_run_concurrently_from_the_connector(runs):
    for i, row in enumerate(runs["shared_warm"]):
        assert row["num_cached_tokens"] > 0
        assert row["tokens"] == runs[f"shared_cold_{i}"]["tokens"]
    assert sum(r["num_external_cached_tokens"] for r in runs["shared_warm"]) > 0


def test_aborts_with_transfers_in_flight_leave_the_engine_serving(runs):
    assert runs["abort"]["aborted"] == 2
    after = runs["after_abort_p1"]
    assert _served(after) > 0 and after["tokens"] == runs["memory_cold_p1"]["tokens"]
    log = runs["memory_log"]
    assert "kvoffload load failed" not in log and "kvoffload save failed" not in log
    assert "Exception in thread" not in log and "EngineDeadError" not in log


def test_corrupted_entries_and_failing_reads_are_recomputed(runs):
    assert runs["corrupted_pages"] > 0
    assert runs["corrupt_p2"]["tokens"] == runs["cold_p2"]["tokens"] and runs["corrupt_log"] >= 1
    if "failing_p1" in runs:
        assert runs["failing_p1"]["tokens"] == runs["cold_p1"]["tokens"] and runs["failing_log"] >= 1


def test_tiered_warm_run_and_preemption(runs):
    warm = runs["tiered_p1"]
    assert _served(warm) > 0 and warm["tokens"] == runs["tiered_cold_p1"]["tokens"] == runs["cold_p1"]["tokens"]
    if "preempt_batch" in runs:
        assert runs["preempt_metrics"].get("num_preemptions", 0) > 0, "the small cache must preempt"
        assert [r["tokens"] for r in runs["preempt_batch"][1:]] == [r["tokens"] for r in runs["preempt_alone"]]


def test_glm_layout_and_bytes_per_token_match_the_footprint(runs):
    if runs["model"] != "glm5next":
        pytest.skip("GLM-5.3-Flash only")
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset

    audit = runs["memory_audit"]
    kinds = sorted(g["kind"] for g in audit["groups"])
    assert kinds.count("state") == 3 and kinds.count("paged") == 1 and kinds.count("skip") == 1, kinds
    expected = PagedCache(preset("vllm-4l"), audit["block_size"], 1, index_format="fp8",
                          device="meta").layout.stored_bytes_per_block()
    assert abs(audit["stored_bytes_per_block"] - expected) <= 0.01 * expected, (audit["stored_bytes_per_block"],
                                                                                  expected)
    print(json.dumps({"block_size": audit["block_size"], "groups": audit["groups"],  # for BENCHMARKS (-rA)
                      "stored_bytes_per_token": audit["stored_bytes_per_block"] / audit["block_size"],
                      "footprint_bytes_per_token": expected / audit["block_size"],
                      "loaded_pages": audit["loaded_pages"], "restart_loaded": runs["restart_audit"]["loaded_pages"]}))


def test_vllms_own_memory_sizing_and_its_extensible_kv_cache(runs):
    """No kv_cache_memory_bytes: vLLM sizes the cache itself, and vLLM 0.34 then maps each layer as a
    segment of its own (its extensible KV cache, on by default on CUDA): pages equal, tokens equal."""
    if "extensible_p1" not in runs:
        pytest.skip("llama-shaped model only")
    from importlib.metadata import version

    warm, audit = runs["extensible_p1"], runs["extensible_audit"]
    assert _served(warm) > 0 and warm["tokens"] == runs["extensible_cold_p1"]["tokens"] == runs["cold_p1"]["tokens"]
    loaded = sum(audit["loaded_pages"].values())
    assert loaded > 0 and audit["mismatches"] == [] and audit["equal_to_store"] == audit["equal_to_saved"] == loaded
    if tuple(int(x) for x in version("vllm").split(".")[:2]) >= (0, 34):
        assert runs["extensible_segments"], "vLLM 0.34 with its own sizing: the extensible KV cache"
