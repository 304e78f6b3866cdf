"""vLLM plugin (entry point group `vllm.general_plugins`): registers `KVOffloadConnector` by name, so
`--kv-transfer-config '{"kv_connector": "KVOffloadConnector", "kv_role": "kv_both"}'` needs no module
path. Imports nothing heavy: vLLM loads plugins in every process (the `kvoffload` and `connectors`
packages import their names on first use; test_imports.py checks that no numpy, lmdb, xxhash, torch or
vLLM comes with this module)."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVOffloadConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVOffloadConnector", "kvoffload.connectors.vllm", "KVOffloadConnector")
