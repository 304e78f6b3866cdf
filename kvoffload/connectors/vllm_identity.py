"""The served model's identity for `KVOffloadConnector` (see `kvoffload.spec.identity`): vLLM's model
config as it runs (hf_overrides applied, the quantization it chose) and the content of the weight files
vLLM loaded, or the `model_revision` the user vouches for. The scheduler and every worker derive it
from the same `vllm_config`, so they agree; equal models agree across restarts and machines."""

from __future__ import annotations

import logging
import os

from ..spec.identity import ModelIdentityError, model_identity, weights_identity

log = logging.getLogger("kvoffload.connectors.vllm")


def _weights_path(vllm_config) -> str | None:
    """Where vLLM's weights are on local disk: the model directory (or file), or the hub snapshot vLLM
    downloaded (never downloads: the workers load the weights before the connector starts)."""
    model_config = vllm_config.model_config
    if getattr(model_config, "model_weights", ""):  # streamed from object storage: not on local disk
        return None
    model = str(model_config.model)
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model,
            revision=model_config.revision,
            local_files_only=True,
            cache_dir=getattr(vllm_config.load_config, "download_dir", None),
        )
    except Exception:  # noqa: BLE001 - not in the local hub cache (ModelScope, a custom loader...)
        return None


def vllm_model_identity(vllm_config, model_revision: str | None) -> str:
    model_config = vllm_config.model_config
    config = dict(model_config.hf_config.to_dict())
    config["kvoffload:quantization"] = model_config.quantization  # online quantization is not in config.json
    try:
        weights = weights_identity(None if model_revision else _weights_path(vllm_config), model_revision)
    except ModelIdentityError as exc:
        raise ModelIdentityError(
            f"KVOffloadConnector: cannot tell which weights {model_config.model!r} serves "
            f"({exc}): set kv_connector_extra_config model_revision to a revision that "
            "names them (a commit, a checksum), or put the weights on local disk"
        ) from None
    identity = model_identity(config, weights)
    log.info("KVOffloadConnector: model identity %s", identity)
    return identity
