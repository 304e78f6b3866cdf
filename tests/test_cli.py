"""The `kvoffload` command as a user runs it."""

import json
import subprocess
import sys

from conftest import subprocess_env


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_demo_round_trip_reports_equal_pages(tmp_path):
    out = _run("demo", "--store-dir", str(tmp_path / "store"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pages_equal"] is True
    assert report["stats"]["misses"] == 0 and report["stats"]["checksum_failures"] == 0
    assert set(report["bytes_per_token"]) == {"kda0", "kda1", "kda2", "mla"}  # the tail ring is never stored
    assert report["stats"]["entries"] == report["pages"]


def test_demo_text_report_and_inspect(tmp_path):
    out = _run("demo", "--store-dir", str(tmp_path / "store"), "--prompts", "2")
    assert out.returncode == 0, out.stderr
    assert "pages equal      yes" in out.stdout
    inspect = _run("inspect", f"lmdb://{tmp_path}/store")
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["entries"] > 0


def test_bad_url_is_a_clear_error_not_a_traceback():
    out = _run("inspect", "lmdb://relative")
    assert out.returncode == 2
    assert "must be absolute" in out.stderr and "Traceback" not in out.stderr
