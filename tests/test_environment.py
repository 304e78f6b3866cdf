"""The environment `make` builds works as a whole: every script in it names an interpreter that exists
(it was built where it lives), `activate` names its own folder, and the commands a user reaches for run,
`vllm` included on the CPU build (`kvoffload.tools.vllm_cli`)."""

import os
import subprocess
import sys

import pytest

VENV = os.path.realpath(sys.prefix)  # run through the .venv link or not
BUILT_BY_MAKE = os.path.exists(os.path.join(VENV, ".complete"))
pytestmark = pytest.mark.skipif(not BUILT_BY_MAKE, reason="runs inside the environment `make` builds")


def _scripts():
    bin_dir = os.path.join(VENV, "bin")
    for name in sorted(os.listdir(bin_dir)):
        path = os.path.join(bin_dir, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as f:
                first = f.readline()
            if first.startswith(b"#!"):
                yield name, first[2:].split()[0].decode()


def test_every_script_names_an_interpreter_that_exists():
    scripts = dict(_scripts())
    assert {"pip", "pytest", "vllm", "kvoffload"} <= set(scripts), sorted(scripts)
    missing = {name: interpreter for name, interpreter in scripts.items() if not os.access(interpreter, os.X_OK)}
    assert not missing, missing


def test_activate_names_this_environment():
    with open(os.path.join(VENV, "bin", "activate")) as f:
        text = f.read()
    assert VENV in text and ".building." not in text


@pytest.mark.parametrize("command", ["pytest", "pip", "vllm", "kvoffload"])
def test_the_commands_run(command):
    out = subprocess.run([os.path.join(VENV, "bin", command), "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if command == "vllm":
        assert out.stdout.strip().splitlines()[-1].startswith("0.")
