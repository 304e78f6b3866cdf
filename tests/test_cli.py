"""The `kvoffload` command as a user runs it (verify and demo: test_verify.py)."""

import json
import subprocess
import sys

from conftest import subprocess_env
from kvoffload import open_store


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_inspect_prints_store_statistics(tmp_path):
    with open_store(f"lmdb://{tmp_path}/store") as store:
        store.put_many([(b"a", b"x" * 10), (b"b", b"y" * 20)])
    out = _run("inspect", f"lmdb://{tmp_path}/store")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["entries"] == 2 and stats["bytes_used"] == 30 + 2 * 56


def test_bad_url_is_a_clear_error_not_a_traceback():
    out = _run("inspect", "lmdb://relative")
    assert out.returncode == 2
    assert "must be absolute" in out.stderr and "Traceback" not in out.stderr
