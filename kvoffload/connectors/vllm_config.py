"""`kv_connector_extra_config`, validated in one place at start-up (both roles): unknown keys, a bad
store URL or policy are a `ConfigError` naming the key, never a crashed engine later."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..errors import ConfigError
from ..paths import vllm_store_url
from ..store import StoreSpec, parse_store_url
from ..store.url import parse_size
from .retention import DEFAULT, StateRetention

LoadFailurePolicy = Literal["recompute", "fail"]  # vLLM's `kv_load_failure_policy` values
LOAD_FAILURE_POLICIES: tuple[LoadFailurePolicy, ...] = ("recompute", "fail")


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class ConnectorConfig:
    store: str = _doc(
        "store URL (memory://, lmdb:///abs/dir, redis://host:port/db, tiered://...); default lmdb "
        "under ~/.cache/kvoffload",
        "",
    )
    namespace: str = _doc("key namespace: deployments that must not share cached prefixes use different ones", "vllm")
    model_id: str | None = _doc("identity of the weights in the layout fingerprint (default: the served model name)")
    model_revision: str | None = _doc(
        "a revision naming the weights (a commit, a checksum): keys use it instead of hashing the weight files"
    )
    load_failure_policy: LoadFailurePolicy = _doc(
        "'recompute' (default: a failed load is a cache miss) or 'fail' (vLLM's own default)", "recompute"
    )
    max_saved_blocks: str | None = _doc(
        "save at most this many leading blocks of each prompt (a per-request cap "
        "on what one request may write; default: every full block)"
    )
    prefetch_bytes: str | None = _doc(
        "tiered:// only: bytes each worker may promote from the slow tier into its "
        "memory tier for requests still queued (prefetch); 0 turns it off; default "
        "a quarter of the memory tier"
    )
    state_retention: str = _doc(
        "the block boundaries whose KDA / Mamba checkpoint is saved, of those vLLM hands "
        "off: 'every', 'last' (where the prompt's longest hit ends), 'last+every:K', "
        "'last+exp', 'last+backexp' (`kvoffload.connectors.retention`)",
        str(DEFAULT),
    )
    spec: StoreSpec = field(init=False, repr=False, compare=False)  # the store URL, parsed once
    retention: StateRetention = field(init=False, repr=False, compare=False)  # state_retention, parsed once

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name, None)
            if f.init and value is not None and not isinstance(value, str):
                raise ConfigError(
                    f"KVOffloadConnector: {f.name} must be a string, got {type(value).__name__} {str(value)[:40]!r}"
                )
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                "KVOffloadConnector: load_failure_policy must be 'recompute' or 'fail', got "
                f"{self.load_failure_policy!r}"
            )
        if not self.namespace:
            raise ConfigError("KVOffloadConnector: namespace must not be empty")
        object.__setattr__(self, "store", self.store or vllm_store_url())
        spec = parse_store_url(self.store)  # a bad URL fails at start-up, in both roles
        object.__setattr__(self, "spec", spec)
        try:
            object.__setattr__(self, "retention", StateRetention.parse(self.state_retention))
        except ConfigError as exc:
            raise ConfigError(f"KVOffloadConnector: state_retention: {exc}") from None
        self.prefetch_budget  # noqa: B018 - a bad size is a StoreConfigError (a ConfigError) at start-up
        if self.max_saved_blocks is not None and not (self.max_saved_blocks.isdigit() and int(self.max_saved_blocks)):
            raise ConfigError(
                "KVOffloadConnector: max_saved_blocks must be a positive whole number of blocks, got "
                f"{self.max_saved_blocks[:40]!r}"
            )

    @property
    def prefetch_budget(self) -> int | None:
        """Prefetch's byte budget per worker: 0 off (also for stores without a slow tier behind memory),
        None the default (a quarter of the memory tier)."""
        if self.spec.memory_front is None:
            return 0
        if self.prefetch_bytes is None or self.prefetch_bytes.strip() == "0":
            return None if self.prefetch_bytes is None else 0
        return parse_size(self.prefetch_bytes, "prefetch_bytes")

    @property
    def max_blocks(self) -> int | None:
        return None if self.max_saved_blocks is None else int(self.max_saved_blocks)

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorConfig:
        """From vLLM's kv_connector_extra_config; an unknown key is refused (a typo must not be ignored)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ConfigError(
                f"KVOffloadConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {sorted(EXTRA_CONFIG_KEYS)}"
            )
        return cls(**{k: v for k, v in extra.items() if v is not None})


EXTRA_CONFIG_KEYS = {f.name: f.metadata["doc"] for f in fields(ConnectorConfig) if f.init}
