"""The vLLM connector binds the served model's identity (config + weight content) into its keys: two
engine processes on one LMDB store, the model changed in place between them (one k_proj weight, then the
RoPE theta in config.json) -> no external hits, the new model's own tokens; unchanged -> hits."""

import json
import os
import re

import pytest

pytest.importorskip("vllm.distributed", reason="the connector tests need vLLM (installed by `make test`)")

from support import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(80)], [(11 * i + 5) % 500 + 3 for i in range(100)]]


def _connector(store: str) -> dict:
    return {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": store}}


def _change_k_proj(model_dir: str) -> None:
    """Rewrite model.safetensors in place with layer 0's k_proj weight changed."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _change_rope_theta(model_dir: str) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_parameters"]["rope_theta"] = 5000.0
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def _external(run) -> list[int]:
    return [r["num_external_cached_tokens"] for r in run]


def test_weights_or_rope_changed_in_place_never_hit(tmp_path):
    model = vh.tiny_llama(str(tmp_path / "model"))
    url = f"lmdb://{tmp_path}/store?capacity=1GiB"
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}  # a private weight digest cache
    run = dict(dtype="float32", block_size=BLOCK, extra_env=env)
    (old,) = vh.run_restart(model, _connector(url), [PROMPTS], **run)
    assert _external(old) == [0, 0]

    _change_k_proj(model)
    result = vh.run_restart(model, _connector(url), [PROMPTS, PROMPTS], **run)
    new_cold, new_warm = result
    assert _external(new_cold) == [0, 0], "the old model's KV was served to the new weights"
    assert [r["num_cached_tokens"] for r in new_cold] == [0, 0]  # computed from scratch: the cold run
    assert [r["tokens"] for r in new_cold] != [r["tokens"] for r in old], "the changed weight must matter"
    assert _external(new_warm) == [64, 96], "unchanged weights across a restart must hit"
    assert [r["tokens"] for r in new_warm] == [r["tokens"] for r in new_cold]
    # the scheduler and the worker derived one identity in each process, a new one after the change; the
    # connector's INFO lines are in vLLM's log without any logging configuration
    identities = re.findall(r"model identity (\S+)", result.log)
    assert len(identities) >= 4 and len(set(identities)) == 1

    _change_rope_theta(model)
    (rope,) = vh.run_restart(model, _connector(url), [PROMPTS], **run)
    assert _external(rope) == [0, 0], "KV computed with another RoPE theta was served"
