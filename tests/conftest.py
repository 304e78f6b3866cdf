import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests mirror the packages (tests/store/, tests/connectors/, tests/vllm/, ...); their helpers are the
# `support` package (`from support import vllm_harness`) and this module (`from conftest import ...`),
# both found through tests/ on the path. There tests/vllm/ reads as a namespace package `vllm` where vLLM
# is not installed, so the tests that need vLLM skip on `vllm.distributed`, not on `vllm`.
sys.path.insert(0, os.path.join(ROOT, "tests"))


def store_urls(tmp_path, capacity="64MiB", memory="64MiB"):
    """One URL per tier, each in its own directory."""
    return {
        "memory": f"memory://?capacity={memory}",
        "lmdb": f"lmdb://{tmp_path}/lmdb?capacity={capacity}",
        "tiered": f"tiered://?memory={memory}&lmdb={tmp_path}/tiered&lmdb_capacity={capacity}",
    }


@pytest.fixture(params=["memory", "lmdb", "tiered"])
def any_store(request, tmp_path):
    from kvoffload import open_store

    store = open_store(store_urls(tmp_path)[request.param], fingerprint=b"test-layout")
    yield store
    store.close()


def subprocess_env(**extra):
    """Environment for child processes that import kvoffload from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny GLM-5.3-Flash checkpoint (seed 0), written once per test session."""
    from glm_integration.checkpoint import write_checkpoint
    from glm_integration.config import preset

    out = tmp_path_factory.mktemp("tiny-glm")
    write_checkpoint(preset("tiny"), 0, str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """(config, model, model_id) of the tiny checkpoint; one thread: tiny matrices, no contention."""
    import torch

    from glm_integration.loader import load_model

    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a directory on a tmpfs of that size ("40m"): a disk that really fills up. Skips
    where mounting is not allowed; unmounted after the test."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
