"""Model identity in keys and fingerprints (`kvoffload.spec.identity`): the whole config and every weight
byte; equal models hit across runner instances and directories, a changed config field or weight byte
never does; the per-file digest cache re-reads exactly the files that changed."""

import json
import os
import shutil
import stat
import struct
import threading
import time

import pytest

from kvoffload.spec import identity
from kvoffload.spec.identity import config_digest, weights_digest

PROMPTS = [[(7 * i + 3) % 500 for i in range(40)], [(11 * i + 5) % 500 for i in range(57)]]
WATCHDOG_S = 30.0


def later() -> int:
    """The digest cache's clock (`clock_ns`) a minute ahead: every file's ctime (now) is past the racy
    window (_RACY_S), so a digest may be cached without sleeping for its ctime to settle."""
    return time.time_ns() + 60 * 10**9


@pytest.fixture
def cache_file(tmp_path):
    return str(tmp_path / "cache" / "weight-digests.json")


def _old(path, seconds=60):
    """Set a file's mtime into the past (its ctime is now: settled only by `later`'s clock)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def _flip_weight_byte(directory, tensor):
    """Change one byte of `tensor`'s data in the safetensors file, in place (the top mantissa bit of its
    first element: finite, a different value)."""
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(n))[tensor]["data_offsets"][0]
        f.seek(8 + n + start + 2)
        byte = f.read(1)[0]
        f.seek(8 + n + start + 2)
        f.write(bytes([byte ^ 0x40]))


def _run(directory, store_url, prompts=PROMPTS, max_tokens=6):
    """A fresh runner instance (model loaded from `directory`) over the store: (tokens, loaded tokens)."""
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine
    from glm_integration.loader import load_model
    from kvoffload import open_store
    from kvoffload.connectors.runner import RunnerConnector

    config, model, model_id = load_model(directory)
    cache = PagedCache(config, 16, 64, model_id=model_id)
    engine = Engine(model, cache)
    if store_url is None:
        requests = engine.generate(prompts, max_tokens)
    else:
        with open_store(store_url, fingerprint=cache.layout.fingerprint) as store:
            RunnerConnector(store, engine)
            requests = engine.generate(prompts, max_tokens)
    return [r.output for r in requests], [r.loaded_tokens for r in requests]


@pytest.fixture
def model_copy(tiny_checkpoint, tmp_path, monkeypatch):
    """A private copy of the tiny checkpoint, and a private digest cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    directory = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint, directory)
    return directory


def test_equal_models_hit_across_instances_and_directories(model_copy, tmp_path):
    """A second runner instance loading the same config and weights from another directory, its config
    written by another library version, gets every hit: nothing path- or writer-bound is in the keys."""
    url = f"lmdb://{tmp_path}/store?capacity=64MiB"
    cold, loaded = _run(model_copy, url)
    assert loaded == [0, 0]
    other = str(tmp_path / "elsewhere" / "model")
    shutil.copytree(model_copy, other)
    _edit_config(other, transformers_version="0.0.0-other", _name_or_path="/somewhere/else")
    warm, loaded = _run(other, url)
    assert warm == cold and loaded == [32, 48]


@pytest.mark.parametrize("change", ["config", "weight"])
def test_changed_model_under_the_same_path_never_hits(model_copy, tmp_path, change):
    """A config field or one weight byte changed in place: zero hits, and the new model's cold tokens."""
    url = f"lmdb://{tmp_path}/store?capacity=64MiB"
    _run(model_copy, url)
    if change == "config":
        _edit_config(model_copy, routed_scaling_factor=1.5)
    else:
        _flip_weight_byte(model_copy, "layers.2.self_attn.kv_a_proj_with_mqa.weight")
    tokens, loaded = _run(model_copy, url)
    assert loaded == [0, 0]
    assert tokens == _run(model_copy, None)[0]
    assert _run(model_copy, url)[1] == [32, 48]  # the new model's own pages do hit


def test_every_byte_of_a_large_checkpoint_counts(tmp_path, cache_file):
    """A checkpoint above any 'hash only the headers' threshold (300 MB, sparse): one data byte changed
    in the middle of a tensor changes the identity."""
    from glm_integration.loader import checkpoint_id

    directory = tmp_path / "big"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "glm5_next_text"}))
    count = 75 << 20
    header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}}).encode()
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * count)
    before = checkpoint_id(str(directory))
    with open(path, "r+b") as f:
        f.seek(8 + len(header) + 2 * count)
        f.write(b"\x01")
    assert checkpoint_id(str(directory)) != before


def test_model_revision_replaces_hashing(model_copy, monkeypatch):
    from glm_integration.loader import checkpoint_id

    monkeypatch.setattr(identity, "_hash_file", lambda *a: pytest.fail("a vouched revision hashes nothing"))
    assert checkpoint_id(model_copy, "r1") != checkpoint_id(model_copy, "r2")
    assert checkpoint_id(model_copy, "r1") == checkpoint_id(model_copy, "r1")


def test_config_digest_is_canonical():
    base = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "hidden_size": 64, "_name_or_path": "/a",
            "transformers_version": "4.0", "text_config": {"_name_or_path": "/a", "head_dim": 8}}
    reordered = {"text_config": {"head_dim": 8, "_name_or_path": "/b"}, "hidden_size": 64,
                 "rope_scaling": {"factor": 4.0, "type": "yarn"}, "_name_or_path": "/b", "transformers_version": "5.1"}
    assert config_digest(base) == config_digest(reordered)
    for changed in ({**base, "rope_scaling": {"type": "yarn", "factor": 8.0}}, {**base, "hidden_size": 65},
                    {**base, "text_config": {"head_dim": 16}}, {**base, "torch_dtype": "bfloat16"}):
        assert config_digest(changed) != config_digest(base)


def _counting(monkeypatch):
    reads = []
    real = identity._hash_file

    def spy(path, *args):
        reads.append(os.path.basename(path))
        return real(path, *args)

    monkeypatch.setattr(identity, "_hash_file", spy)
    return reads


def test_digest_cache_rereads_only_changed_files(tmp_path, cache_file, monkeypatch):
    directory = tmp_path / "w"
    directory.mkdir()
    for name in ("a.safetensors", "b.bin"):
        (directory / name).write_bytes(os.urandom(4096))
        _old(directory / name)
    (directory / "notes.txt").write_bytes(b"not a weight")
    reads = _counting(monkeypatch)
    first = weights_digest(str(directory), cache_path=cache_file, clock_ns=later)
    assert sorted(reads) == ["a.safetensors", "b.bin"]
    assert weights_digest(str(directory), cache_path=cache_file, clock_ns=later) == first
    assert len(reads) == 2  # nothing re-read

    # Same size, new content, then its old mtime put back: ctime still moved, so it is hashed again.
    path = directory / "a.safetensors"
    st = os.stat(path)
    path.write_bytes(os.urandom(4096))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads.clear()
    second = weights_digest(str(directory), cache_path=cache_file, clock_ns=later)
    assert reads == ["a.safetensors"] and second != first

    _old(path, 120)  # only the mtime changed: re-read, same content, same digest
    reads.clear()
    assert weights_digest(str(directory), cache_path=cache_file, clock_ns=later) == second
    assert reads == ["a.safetensors"]


def test_digest_cache_file_is_private_json_and_survives_damage(tmp_path, cache_file, monkeypatch):
    directory = tmp_path / "w"
    directory.mkdir()
    (directory / "m.safetensors").write_bytes(b"x" * 100)
    _old(directory / "m.safetensors")
    digest = weights_digest(str(directory), cache_path=cache_file, clock_ns=later)
    assert stat.S_IMODE(os.stat(cache_file).st_mode) == 0o600
    with open(cache_file) as f:
        (entry,) = json.load(f).values()
    assert set(entry) == {"key", "xxh3_128", "used"}
    reads = _counting(monkeypatch)
    bad_digest = {os.path.realpath(directory / "m.safetensors"): {**entry, "xxh3_128": "zz"}}
    for damage in ("{ damaged", json.dumps(bad_digest), json.dumps([1, 2]), json.dumps({"x": 1})):
        with open(cache_file, "w") as f:
            f.write(damage)
        reads.clear()
        assert weights_digest(str(directory), cache_path=cache_file, clock_ns=later) == digest
        assert reads == ["m.safetensors"]
    assert not [n for n in os.listdir(os.path.dirname(cache_file)) if n.startswith(".weight-digests-")]


def test_a_file_written_just_now_is_not_cached(tmp_path, monkeypatch):
    """Its timestamps could still match a later write in the same clock tick ("racy clean"): a file
    changed within _RACY_S of now (the cache's clock, set here relative to the file's own times) is
    hashed every time; once the window has passed, cached."""
    cache_file = str(tmp_path / "cache" / "weight-digests.json")
    directory = tmp_path / "w"
    directory.mkdir()
    path = directory / "m.safetensors"
    path.write_bytes(b"y" * 100)
    st = os.stat(path)
    changed = max(st.st_mtime_ns, st.st_ctime_ns)
    window = int(identity._RACY_S * 1e9)
    reads = _counting(monkeypatch)
    for now in (changed, changed + window // 2, changed + window):  # still within the window: not cached
        weights_digest(str(directory), cache_path=cache_file, clock_ns=lambda now=now: now)
    assert reads == ["m.safetensors"] * 3
    weights_digest(str(directory), cache_path=cache_file, clock_ns=lambda: changed + window + 1)  # settled
    assert weights_digest(str(directory), cache_path=cache_file, clock_ns=lambda: changed + window + 1)
    assert reads == ["m.safetensors"] * 4  # the settled file's digest was cached: not read again
    assert weights_digest(str(directory), cache_path=cache_file) and reads == ["m.safetensors"] * 4  # real clock


def test_no_weight_files_is_a_clear_error(tmp_path):
    from glm_integration.config import ModelConfigError
    from glm_integration.loader import checkpoint_id

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="no weight files"):
        checkpoint_id(str(tmp_path))


def test_concurrent_starts_hash_each_file_once(tmp_path, cache_file, monkeypatch):
    """The scheduler and the workers start together: one hashes, the others wait and read its digest."""
    directory = tmp_path / "w"
    directory.mkdir()
    (directory / "m.safetensors").write_bytes(os.urandom(1 << 16))
    _old(directory / "m.safetensors")
    reads = []
    real = identity._hash_file
    waiting = threading.Event()  # another start found the digest cache locked by the one hashing

    def slow(path, *args):  # the hash lasts until another start is waiting for it
        reads.append(path)
        assert waiting.wait(WATCHDOG_S), "no other start waited for the one hashing"
        return real(path, *args)

    def say(message):
        said.append(message)
        if message == "kvoffload: waiting for another process hashing model weights":
            waiting.set()

    monkeypatch.setattr(identity, "_hash_file", slow)
    said, results = [], []
    threads = [threading.Thread(target=lambda: results.append(
        weights_digest(str(directory), cache_path=cache_file, progress=say, clock_ns=later))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    assert not any(t.is_alive() for t in threads), "a start is stuck"
    assert len(results) == 3 and len(set(results)) == 1
    assert len(reads) == 1
    assert "kvoffload: waiting for another process hashing model weights" in said


def test_vllm_hub_repo_id_uses_the_downloaded_snapshot(tmp_path, monkeypatch):
    """A repo id (not a directory): the snapshot vLLM downloaded into the hub cache is hashed, never
    fetched; a repo that is not there needs model_revision, said at start-up."""
    pytest.importorskip("huggingface_hub")
    from types import SimpleNamespace as NS

    from kvoffload.connectors.vllm_identity import vllm_model_identity
    from kvoffload.spec.identity import ModelIdentityError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    hub, commit = tmp_path / "hub", "a" * 40
    repo = hub / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"w" * 64)
    model_config = NS(model="org/tiny", revision=None, quantization=None, model_weights="",
                      hf_config=NS(to_dict=lambda: {"model_type": "llama", "_name_or_path": "org/tiny"}))
    vllm_config = NS(model_config=model_config, load_config=NS(download_dir=str(hub)))
    first = vllm_model_identity(vllm_config, None)
    assert first == vllm_model_identity(vllm_config, None)
    (snapshot / "model.safetensors").write_bytes(b"v" * 64)
    assert vllm_model_identity(vllm_config, None) != first
    assert vllm_model_identity(vllm_config, "c0ffee").endswith("/revision:c0ffee")
    model_config.model = "org/absent"
    with pytest.raises(ModelIdentityError, match="set kv_connector_extra_config model_revision"):
        vllm_model_identity(vllm_config, None)
