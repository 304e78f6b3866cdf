"""Build a runnable model from a checkpoint directory, with an identity for the layout fingerprint:
pages computed with other weights must never be served, so the weights are part of the model id."""

from __future__ import annotations

import json
import os

from kvoffload.spec.identity import ModelIdentityError, model_identity, weights_identity

from .config import GlmConfig, ModelConfigError
from .model import GlmModel
from .weights import load_weights


def checkpoint_id(directory: str, model_revision: str | None = None) -> str:
    """The model's identity (`kvoffload.spec.identity`): its config.json and the content of every weight
    file, or `model_revision` instead of the weights when the caller vouches for one (nothing hashed).
    Equal on every machine for the same files; any changed config field or weight byte changes it."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except ValueError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    try:
        return f"glm5next:{model_identity(config, weights_identity(directory, model_revision))}"
    except ModelIdentityError as exc:
        raise ModelConfigError(str(exc)) from None


def load_model(
    directory: str, device: str = "cpu", model_revision: str | None = None
) -> tuple[GlmConfig, GlmModel, str]:
    """(config, model with its weights on `device`, model id: `checkpoint_id`)."""
    config = GlmConfig.from_pretrained(directory)
    weights = {name: t.to(device) for name, t in load_weights(directory, config=config).items()}
    return config, GlmModel(config, weights), checkpoint_id(directory, model_revision)
