import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
