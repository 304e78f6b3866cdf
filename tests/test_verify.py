"""`kvoffload verify` end to end on the tiny runner, and mutations that prove it can fail."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import store_urls, subprocess_env
from kvoffload.connectors import offloader as offloader_module
from kvoffload.connectors import plan as plan_module
from kvoffload.connectors.transfer import HostTransfer
from kvoffload.spec import GroupKind
from kvoffload.tools.verify import verify


def _check_all_equal(report):
    assert report["ok"], report["problems"]
    for p in report["prompts"]:
        assert p["tokens_equal"] and p["pages_equal"], p
        assert p["hit_tokens"] == p["expected_hit_tokens"]
        if p["prompt_tokens"] > 16:  # a full block and one more token: a cacheable prefix exists
            assert p["hit_tokens"] > 0, p
    assert report["totals"]["restored_pages"] > 0
    assert report["totals"]["stored_bytes_per_token"] == report["totals"]["expected_bytes_per_token"]


@pytest.mark.parametrize("tier", ["memory", "lmdb", "tiered"])
def test_verify_in_process(tmp_path, tiny_checkpoint, tier):
    _check_all_equal(verify(store_urls(tmp_path, capacity="1GiB")[tier], model_dir=tiny_checkpoint))


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["lmdb", "tiered"])
def test_verify_across_a_restart(tmp_path, tiny_checkpoint, tier):
    _check_all_equal(verify(store_urls(tmp_path, capacity="1GiB")[tier], model_dir=tiny_checkpoint, restart=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(
    "tier,restart", [("memory", False), ("lmdb", False), ("lmdb", True), ("tiered", False), ("tiered", True)]
)
def test_verify_on_the_gpu(tmp_path, tiny_checkpoint, tier, restart):
    report = verify(store_urls(tmp_path, capacity="1GiB")[tier], model_dir=tiny_checkpoint, device="cuda",
                    restart=restart)
    assert report["device"] == "cuda" and report["kernels"] == "triton"
    _check_all_equal(report)


def test_memory_store_cannot_verify_a_restart(tiny_checkpoint):
    from kvoffload.store import StoreConfigError

    for mode in ({"restart": True}, {"separate": True}):
        with pytest.raises(StoreConfigError, match="lives in one process"):
            verify("memory://", model_dir=tiny_checkpoint, **mode)


def test_bytes_stored_are_the_cacheable_groups_used_bytes(tmp_path, tiny_checkpoint):
    report = verify("memory://", model_dir=tiny_checkpoint)
    totals = report["totals"]
    assert sum(totals["bytes_per_token_by_group"].values()) == totals["expected_bytes_per_token"]
    assert "tail" not in totals["bytes_per_token_by_group"]
    assert totals["stored_bytes_per_token"] < totals["whole_packed_block_bytes_per_token"] / 3


# -- mutations: each must make verify fail ----------------------------------------------------------

def test_mutation_corrupt_one_restored_page(monkeypatch, tiny_checkpoint):
    real = HostTransfer.scatter
    done = []

    def corrupting(self, group, block, page):
        real(self, group, block, page)
        if not done and group.kind is GroupKind.PAGED:
            offset = group.regions[0].page_offset(0, block)
            self.buffer[offset] ^= 0x40
            done.append(True)

    monkeypatch.setattr(HostTransfer, "scatter", corrupting)
    report = verify("memory://", model_dir=tiny_checkpoint)
    assert done and not report["ok"]
    assert report["totals"]["pages_equal"] < report["totals"]["prompts"]


def test_mutation_drop_a_kda_state(monkeypatch, tiny_checkpoint):
    real = plan_module.pages_for_load

    def without_state(layout, keys, start, end, table=None):
        return [p for p in real(layout, keys, start, end, table) if p.group.kind is not GroupKind.STATE]

    monkeypatch.setattr(offloader_module, "pages_for_load", without_state)
    report = verify("memory://", model_dir=tiny_checkpoint)
    assert not report["ok"]
    assert report["totals"]["pages_equal"] < report["totals"]["prompts"]
    assert report["totals"]["tokens_equal"] < report["totals"]["prompts"]  # the model notices too


def test_mutation_store_and_restore_the_tail_ring(monkeypatch, tiny_checkpoint):
    """The bug class of upstream connectors: the per-request kpool ring treated as a cacheable page,
    so one request's ring travels to another."""
    def with_tail(layout, keys, blocks, kind, rank=None, table=None):
        wanted = (kind, GroupKind.SKIP) if kind is GroupKind.PAGED else (kind,)
        groups = [g for g in layout.groups if g.kind in wanted]
        return [plan_module.Page(plan_module.page_key(keys[i], g.name), g, i,
                                 None if table is None else plan_module.physical_block(table, g, i))
                for i in blocks for g in groups]

    monkeypatch.setattr(plan_module, "_pages", with_tail)
    report = verify("memory://", model_dir=tiny_checkpoint)
    assert not report["ok"]
    assert any("SKIP group" in p for p in report["problems"])


# -- the command ----------------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)


def test_verify_command_json_and_prompt_file(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n" + " ".join(str(i % 500) for i in range(40)) + "\n\n")
    out = _cli("verify", "--model", tiny_checkpoint, "--prompts", str(prompts), "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and len(report["prompts"]) == 2
    assert report["prompts"][1]["hit_tokens"] == 32
    assert {"tokens_equal", "pages_equal", "hit_tokens", "cold_prefill_seconds",
            "warm_prefill_seconds"} <= set(report["prompts"][0])


def _shared_prefix_prompts(path):
    """A prompt file as users write them: a common system prompt, turns that extend a conversation,
    a line diverging mid-block, an exact repeat."""
    system = [(7 * i + 3) % 500 for i in range(40)]  # 2.5 blocks of 16: diverging lines part mid-block
    turn = system + [(11 * i + 5) % 500 for i in range(20)]
    lines = [system + [1, 2, 3, 4, 5], turn, turn + [(13 * i) % 500 for i in range(18)], system[:37] + [9] * 12,
             turn, system[:32] + [4] * 16]
    path.write_text("".join(" ".join(map(str, line)) + "\n" for line in lines))
    return lines


def test_verify_command_prompts_sharing_prefixes(tmp_path, tiny_checkpoint):
    """Each line is cold on its own, whatever an earlier line of the same run saved."""
    lines = _shared_prefix_prompts(tmp_path / "chat.txt")
    out = _cli("verify", "--model", tiny_checkpoint, "--prompts", str(tmp_path / "chat.txt"), "--json", "--quiet",
               "--max-tokens", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and not report["problems"] and len(report["prompts"]) == len(lines)
    _check_all_equal(report)
    assert [p["hit_tokens"] for p in report["prompts"]] == [32, 48, 64, 48, 48, 32]


def test_verify_prompt_file_on_lmdb_and_a_reused_store(monkeypatch, tmp_path, tiny_checkpoint):
    """The cold run's store-was-empty check still fails where the store really held this run's pages:
    a persistent store kept from an earlier run of the same namespace."""
    import uuid

    from kvoffload.tools import verify as verify_module

    _shared_prefix_prompts(tmp_path / "chat.txt")
    monkeypatch.setattr(verify_module.uuid, "uuid4", lambda: uuid.UUID(int=14))  # both runs: one namespace
    url = f"lmdb://{tmp_path}/db?capacity=256MiB"
    first = verify(url, model_dir=tiny_checkpoint, prompts_file=str(tmp_path / "chat.txt"), max_tokens=3)
    _check_all_equal(first)
    again = verify(url, model_dir=tiny_checkpoint, prompts_file=str(tmp_path / "chat.txt"), max_tokens=3)
    assert not again["ok"]
    assert any("store was not empty" in p for p in again["problems"]), again["problems"]


def test_verify_command_refuses_bad_input(tmp_path, tiny_checkpoint):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x\n")
    out = _cli("verify", "--model", tiny_checkpoint, "--prompts", str(bad))
    assert out.returncode == 2 and "space-separated token ids" in out.stderr
    out = _cli("verify", "--model", tiny_checkpoint, "--store", "memory://", "--restart")
    assert out.returncode == 2 and "lives in one process" in out.stderr


@pytest.mark.slow
def test_demo_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "demo", "--store", f"lmdb://{tmp_path}/demo?capacity=256MiB"],
                         env=subprocess_env(XDG_CACHE_HOME=tmp_path / "cache"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "result           OK" in out.stdout and "tail ring 0" in out.stdout
    assert "process restarted" in out.stderr


def test_failed_loads_are_recomputed(tmp_path, tiny_model):
    """A store that fails every read, and one whose pages were corrupted on disk: same tokens, no crash."""
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine
    from kvoffload import open_store
    from kvoffload.connectors.runner import RunnerConnector

    config, model, model_id = tiny_model
    prompts = [list(np.arange(40) % 500), list(np.arange(3, 60) % 500)]
    url = f"lmdb://{tmp_path}/db?capacity=256MiB"

    def run(store):
        engine = Engine(model, PagedCache(config, 16, 64, model_id=model_id))
        connector = RunnerConnector(store, engine)
        return [r.output for r in engine.generate([list(map(int, p)) for p in prompts], 6)], connector, engine

    with open_store(url) as store:
        cold, _, _ = run(store)
        assert store.stats()["entries"] > 0

    class FailingReads:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            return getattr(self.store, name)

        def read_many(self, keys, consume):
            raise OSError("injected read failure")

    with open_store(url) as store:
        tokens, connector, _ = run(FailingReads(store))
    assert tokens == cold and connector.offloader.counters["load_failures"] >= 1

    import lmdb

    env = lmdb.open(f"{tmp_path}/db", readonly=True, lock=False, max_dbs=8)
    with env.begin() as txn:
        pages = [bytes(value) for _, value in txn.cursor(env.open_db(b"data", txn=txn, create=False))]
    env.close()
    with open(f"{tmp_path}/db/data.mdb", "r+b") as data:  # flip one byte inside every stored page
        raw = bytearray(data.read())
        for page in pages:
            at = raw.find(page[:256])
            assert at >= 0
            raw[at + len(page) // 2] ^= 0xFF
        data.seek(0)
        data.write(raw)
    with open_store(url) as store:
        tokens, connector, _ = run(store)
        stats = store.stats()
    assert tokens == cold
    assert stats["checksum_failures"] > 0 and connector.offloader.counters["load_failures"] >= 1
