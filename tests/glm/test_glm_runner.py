"""The bundled runner against transformers' reference, and its own consistency: chunking, prefix reuse,
the indexer's sparse path, the layout it describes."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import subprocess_env
from glm_integration.cache import PagedCache
from glm_integration.engine import Engine
from glm_integration.kernels import torch_ref
import glm_integration.kernels as kernels
from kvoffload.spec import GroupKind

LENGTHS = [1, 3, 4, 5, 16, 17, 40, 64]


def _prompt(config, n, seed=1):
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed * 1000 + n)).tolist()


def _engine(tiny_model, **kw):
    config, model, model_id = tiny_model
    return Engine(model, PagedCache(config, 16, 128, model_id=model_id), **kw)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint, tiny_model):
    pytest.importorskip("transformers")
    from support.glm_oracle import Oracle

    return Oracle(tiny_checkpoint, tiny_model[1].lm_head)


@pytest.fixture
def selections(monkeypatch):
    """Record every pooled top-k selection the runner makes."""
    seen = []

    def spy(scores, visible, k):
        chosen = torch_ref.select_pools(scores, visible, k)
        seen.append((visible.sum(-1), chosen.sum(-1), k))
        return chosen

    monkeypatch.setitem(kernels._backends["torch"], "select_pools", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("n", LENGTHS)
def test_greedy_tokens_equal_the_transformers_reference(tiny_model, oracle, n):
    config = tiny_model[0]
    prompt = _prompt(config, n)
    ours = _engine(tiny_model).generate([prompt], 16)[0].output
    assert ours == oracle.greedy(prompt, 16)


@pytest.mark.parametrize("n", [3, 17, 64])
def test_logits_agree_with_the_reference(tiny_model, oracle, n):
    """Tolerance: fp32 everywhere; the runner's KDA chunk is a closed-form triangular solve per block
    where transformers scans 64-token chunks, and its attention masks instead of SDPA: rounding differs
    at ~1e-6 relative, amplified through 5 layers and a wide LM head to ~1e-5 absolute on logits of
    magnitude ~10. 1e-3 leaves margin while any real semantic difference (a wrong pool, a missing tail
    token, a dropped state) moves logits by 1e-1 or more."""
    config, model, _ = tiny_model
    prompt = _prompt(config, n)
    engine = _engine(tiny_model, split_at_blocks=False, prefill_chunk=10_000)
    request = engine.add(prompt, 1)
    engine.ensure_blocks(request, n)
    from glm_integration.layers.chunk import Chunk

    ours = model.forward(prompt, Chunk(0, n, tuple(request.blocks), request.tail_block, 16), engine.cache)
    reference = oracle.logits(prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-3
    assert reference.abs().max().item() > 1.0  # the comparison is not vacuous


def test_long_prompts_really_use_pooled_sparse_selection(tiny_model, selections):
    config = tiny_model[0]
    _engine(tiny_model).generate([_prompt(config, 64)], 4)
    k = config.index_topk // config.index_kpool
    assert selections, "no pooled selection ran for a prompt longer than index_topk"
    assert any(bool((visible > k).any()) and bool((chosen == k).all()) for visible, chosen, _ in selections)


def test_short_prompts_stay_dense_and_attend_their_own_tokens(tiny_model, selections, oracle):
    config = tiny_model[0]
    for n in (1, 2, 3):
        prompt = _prompt(config, n)
        assert _engine(tiny_model).generate([prompt], 4)[0].output == oracle.greedy(prompt, 4)
    assert not selections  # shorter than one pool: no pool exists, every token <= t is attended


def test_short_prompt_mask_contains_the_query_token(tiny_model):
    from glm_integration.layers.attention import Indexer
    from glm_integration.layers.chunk import Chunk

    config, model, _ = tiny_model
    indexer = next(layer.attn.indexer for layer in model.layers if hasattr(layer.attn, "indexer"))
    engine = _engine(tiny_model)
    request = engine.add([5, 6, 7], 1)
    engine.ensure_blocks(request, 3)
    x = torch.randn(3, config.hidden_size)
    mask = Indexer.select(indexer, x, torch.randn(3, config.q_lora_rank),
                          Chunk(0, 3, tuple(request.blocks), request.tail_block, 16), engine.cache)
    assert mask.diagonal().all() and not mask.triu(1).any()


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7])
def test_chunks_resuming_mid_pool_match_one_shot_prefill(tiny_model, chunk):
    """Chunks that end mid-pool (the ring carries the open pool) or add fewer rows than a pool."""
    config = tiny_model[0]
    for n in (17, 40):
        prompt = _prompt(config, n, seed=3)
        one_shot = _engine(tiny_model, split_at_blocks=False, prefill_chunk=10_000).generate([prompt], 8)[0]
        chunked = _engine(tiny_model, prefill_chunk=chunk).generate([prompt], 8)[0]
        assert chunked.output == one_shot.output, (n, chunk)


def test_second_request_reuses_a_shared_block_aligned_prefix(tiny_model):
    config = tiny_model[0]
    shared = _prompt(config, 32, seed=4)
    a, b = shared + _prompt(config, 9, seed=5), shared + _prompt(config, 6, seed=6)
    alone = _engine(tiny_model).generate([b], 8)[0]
    engine = _engine(tiny_model)
    first = engine.add(a, 8)
    engine.prefill(first)
    second = engine.add(b, 8)
    assert second.cached_tokens == 32
    assert second.blocks[:2] == first.blocks[:2]
    engine.prefill(second)
    while not (first.done and second.done):
        for r in (first, second):
            if not r.done:
                engine.decode_step(r)
    assert second.output == alone.output


def test_prefix_hit_leaves_one_token_to_compute(tiny_model):
    config = tiny_model[0]
    prompt = _prompt(config, 32, seed=7)
    engine = _engine(tiny_model)
    cold = engine.generate([prompt], 4)[0]
    warm = engine.generate([prompt], 4)[0]
    assert warm.cached_tokens == 16  # 32 tokens = 2 full blocks, but the last block is recomputed
    assert warm.output == cold.output


def test_indexer_fp8_rows_are_vllm_sized_and_close(tiny_model):
    config = tiny_model[0]
    cache = PagedCache(config, 16, 4, index_format="fp8")
    assert cache.index_row_bytes == 132 and cache.index_rows(2).shape[-1] == 132
    pooled = torch.randn(5, config.index_head_dim)
    restored = cache.decode_index_rows(cache.encode_index_rows(pooled))
    assert (restored - pooled).abs().max() <= pooled.abs().max() / 8  # e4m3: 3 mantissa bits
    fp8 = Engine(tiny_model[1], PagedCache(config, 16, 128, index_format="fp8"))
    first, again = (fp8.generate([_prompt(config, 40)], 4)[0] for _ in range(2))
    assert len(first.output) == 4 and again.cached_tokens == 32 and again.output == first.output


@pytest.mark.parametrize("name, kda_groups", [("pruned-4l", 3), ("full", 4)])
def test_layout_of_presets(name, kda_groups):
    from glm_integration.config import preset

    config = preset(name)
    cache = PagedCache(config, 64, 1, index_format="fp8", device="meta")
    layout = cache.layout
    kinds = {g.name: g.kind for g in layout.groups}
    assert kinds["tail"] is GroupKind.SKIP and kinds["mla"] is GroupKind.PAGED
    state = [g for g in layout.groups if g.kind is GroupKind.STATE]
    assert len(state) == kda_groups
    assert len({g.layer_names for g in state}) == kda_groups and sum(len(g.layer_names) for g in state) == len(
        config.kda_layers)
    spans = sorted((r.offset + i * r.layer_stride, r.offset + i * r.layer_stride + r.used_bytes)
                   for g in layout.groups for r in g.regions for i in range(r.num_layers))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two pages of one block overlap"
    mla_layers = len(config.mla_layers)
    latent = 64 * config.kv_lora_rank * 2  # bf16 latent rows
    index = (64 // config.index_kpool) * 132  # fp8 rows + scale per pool
    kda = 3 * config.linear_num_heads * config.linear_head_dim * 3 * 2 + config.linear_num_heads * 128 * 128 * 4
    assert layout.group("mla").used_bytes_per_block == mla_layers * (latent + index)
    assert sum(g.used_bytes_per_block for g in state) == len(config.kda_layers) * kda
    assert layout.stored_bytes_per_block() == mla_layers * (latent + index) + len(config.kda_layers) * kda
    if name == "pruned-4l":
        assert layout.stored_bytes_per_block() == 67648 + 3 * 4341760


def test_generate_and_layout_commands(tiny_checkpoint):
    out = subprocess.run([sys.executable, "-m", "glm_integration.generate", "--model", tiny_checkpoint,
                          "--prompt-ids", "1 2 3 4 5", "--max-tokens", "6", "--json"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 6
    out = subprocess.run([sys.executable, "-m", "glm_integration.layout", "--preset", "full", "--json"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    groups = {g["name"]: g["kind"] for g in json.loads(out.stdout)["groups"]}
    assert groups["tail"] == "skip" and groups["mla"] == "paged"
