"""`kv_connector_extra_config` validated in one place (`connectors.vllm_config.ConnectorConfig`): every
bad value is a `ConfigError` (a `KVOffloadError` and a `ValueError`, as vLLM expects) naming what to fix."""

import pytest

from kvoffload.connectors.vllm_config import EXTRA_CONFIG_KEYS, ConnectorConfig
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.store import LMDBSpec, MemorySpec, StoreConfigError


@pytest.mark.parametrize("extra, error, message", [
    ({"colour": "blue"}, ConfigError, r"unknown kv_connector_extra_config key\(s\) \['colour'\]"),
    ({"load_failure_policy": "sometimes"}, ConfigError, "load_failure_policy must be 'recompute' or 'fail'"),
    ({"store": "lmdb://"}, StoreConfigError, "needs an absolute directory"),
    ({"store": "redis://h:1/0?timeout=soon"}, StoreConfigError, "timeout="),
    ({"store": "tiered://?lmdb=/d&write=through&admit=2"}, StoreConfigError, "admit= above 1 needs write=behind"),
    ({"namespace": 7}, ConfigError, "namespace must be a string"),
    ({"store": ["lmdb:///d"]}, ConfigError, "store must be a string"),
    ({"state_retention": "last+expo"}, ConfigError, "state_retention: .*unknown rule 'expo'"),
    ({"state_retention": "every:0"}, ConfigError, "state_retention: .*every:K needs a whole number K >= 1"),
])
def test_bad_values_are_config_errors(extra, error, message):
    with pytest.raises(error, match=message) as raised:
        ConnectorConfig.from_extra(extra)
    assert isinstance(raised.value, KVOffloadError) and isinstance(raised.value, ValueError)


def test_defaults_and_the_parsed_store(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = ConnectorConfig.from_extra(None)
    assert (config.namespace, config.load_failure_policy, config.model_id, config.model_revision) == \
        ("vllm", "recompute", None, None)
    assert config.store == f"lmdb://{tmp_path}/kvoffload/vllm-store?capacity=16GiB"
    assert config.spec == LMDBSpec(f"{tmp_path}/kvoffload/vllm-store", 16 << 30)
    config = ConnectorConfig.from_extra({"store": "memory://?capacity=1MiB", "namespace": "a", "model_revision": "r1",
                                         "load_failure_policy": "fail"})
    assert config.spec == MemorySpec(1 << 20) and config.namespace == "a" and config.model_revision == "r1"
    config = ConnectorConfig.from_extra({"store": "tiered://?memory=1MiB&lmdb=/d&admit=2"})  # its memory: mirrored
    assert config.spec.admit == 2 and config.spec.memory == MemorySpec(1 << 20)


def test_the_documented_keys_are_the_fields():
    assert set(EXTRA_CONFIG_KEYS) == {"store", "namespace", "model_id", "model_revision", "load_failure_policy",
                                     "max_saved_blocks", "prefetch_bytes", "state_retention"}
    assert all(EXTRA_CONFIG_KEYS.values())


def test_state_retention_is_parsed_once():
    from kvoffload.connectors.retention import DEFAULT, StateRetention

    config = ConnectorConfig.from_extra({"store": "memory://?capacity=1MiB", "state_retention": "last+every:4"})
    assert config.retention == StateRetention(last=True, every=4)
    assert ConnectorConfig.from_extra({"store": "memory://?capacity=1MiB"}).retention == DEFAULT
