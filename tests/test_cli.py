"""The `kvoffload` command as a user runs it (verify and demo: test_verify.py)."""

import json
import os
import stat
import subprocess
import sys

from conftest import subprocess_env
from kvoffload import open_store
from kvoffload.store.lmdb_store import entry_charge


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_inspect_prints_store_statistics(tmp_path):
    with open_store(f"lmdb://{tmp_path}/store?capacity=1MiB") as store:
        store.put_many([(b"a", b"x" * 10), (b"b", b"y" * 20)])
    before = sorted(os.listdir(tmp_path / "store"))
    out = _run("inspect", f"lmdb://{tmp_path}/store")  # no capacity given: the store's own is reported
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["entries"] == 2 and stats["bytes_used"] == entry_charge(10) + entry_charge(20)
    assert stats["capacity"] == 1 << 20 and stats["format_version"] == 1
    assert sorted(os.listdir(tmp_path / "store")) == before


def test_inspect_never_creates_a_store(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o755)
    os.chmod(plain, 0o755)
    (plain / "notes.txt").write_text("x")
    for path in (tmp_path / "missing", plain):
        out = _run("inspect", f"lmdb://{path}")
        assert out.returncode == 2 and "no LMDB store" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "missing").exists()
    assert sorted(os.listdir(plain)) == ["notes.txt"] and stat.S_IMODE(os.stat(plain).st_mode) == 0o755
    out = _run("inspect", "memory://?capacity=1GiB")
    assert out.returncode == 2 and "nothing to inspect" in out.stderr


def test_bad_url_is_a_clear_error_not_a_traceback():
    out = _run("inspect", "lmdb://relative")
    assert out.returncode == 2
    assert "must be absolute" in out.stderr and "Traceback" not in out.stderr


def test_exit_2_for_a_kvoffload_error_and_a_traceback_for_a_bug(monkeypatch, capsys):
    """Only kvoffload's own errors (and OS errors about named files) are one line with exit status 2:
    any other exception, a ValueError included, is a bug and propagates (a traceback, exit 1)."""
    import pytest

    import kvoffload.store
    from kvoffload import cli
    from kvoffload.errors import KVOffloadError, LayoutError

    for error in (KVOffloadError("the store says no"), LayoutError("the store says no")):
        def refuse(url, error=error):
            raise error

        monkeypatch.setattr(kvoffload.store, "inspect_store", refuse)
        assert cli.main(["inspect", "memory://"]) == 2
        assert capsys.readouterr().err == "kvoffload: the store says no\n"
    for bug in (RuntimeError("an internal bug"), ValueError("an internal bug")):
        def broken(url, bug=bug):
            raise bug

        monkeypatch.setattr(kvoffload.store, "inspect_store", broken)
        with pytest.raises(type(bug), match="an internal bug"):
            cli.main(["inspect", "memory://"])


def test_inspect_reports_the_file_its_map_and_what_it_can_hold(tmp_path):
    with open_store(f"lmdb://{tmp_path}/store?capacity=8MiB") as store:
        store.put_many([(b"a", b"x" * 10)])
    stats = json.loads(_run("inspect", f"lmdb://{tmp_path}/store").stdout)
    size = os.path.getsize(tmp_path / "store" / "data.mdb")
    assert stats["file_bytes"] == size and stats["map_size"] >= size > 8 << 20, stats
    assert stats["usable_capacity"] == stats["capacity"] == 8 << 20 and stats["disk_bytes"] > 0


def test_inspect_refuses_a_symlinked_or_empty_data_file(tmp_path):
    with open_store(f"lmdb://{tmp_path}/real?capacity=1MiB") as store:
        store.put_many([(b"a", b"x")])
    (tmp_path / "linked").mkdir()
    os.symlink(tmp_path / "real" / "data.mdb", tmp_path / "linked" / "data.mdb")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.mdb").write_bytes(b"")
    for name, message in (("linked", "is a symbolic link"), ("empty", "its data.mdb is empty")):
        out = _run("inspect", f"lmdb://{tmp_path}/{name}")
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, out.stderr
