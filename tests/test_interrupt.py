"""Ctrl-C on the long commands: one line ("kvoffload: interrupted"), exit status 130, and nothing of
theirs left running (engine processes included) within 10 s."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import subprocess_env

pytestmark = pytest.mark.slow


def _interrupt_after(args, ready: str, tmp_path, settle=1.0, wait_s=240.0):
    """Start `kvoffload ARGS` in its own process group (as a terminal's foreground job), send the group
    SIGINT `settle` seconds after stderr shows `ready`, and return (exit status, stderr, seconds to exit)."""
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    # SIGINT as a terminal's foreground job has it: a suite started in the background (`cmd &` in a script)
    # passes it on ignored, and Python never turns an ignored SIGINT into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.cli", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, deadline = "", time.monotonic() + wait_s
    while ready not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen[-3000:]
        if select.select([proc.stderr], [], [], 1.0)[0]:
            seen += proc.stderr.readline()
    time.sleep(settle)  # into the work that line announced
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    rest = proc.communicate(timeout=30)[1]
    took = time.monotonic() - t0
    alive = []
    for _ in range(20):  # the group's last processes may take a moment to be reaped
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        alive = subprocess.run(["ps", "-g", str(proc.pid), "-o", "pid,cmd"], capture_output=True, text=True).stdout
        time.sleep(0.5)
    else:
        pytest.fail(f"processes left after Ctrl-C:\n{alive}")
    return proc.returncode, rest, took


def _assert_interrupted(code, stderr, took):
    assert code == 130, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "kvoffload: interrupted", stderr[-3000:]
    assert took < 10, took


def test_ctrl_c_during_demo(tmp_path):
    _assert_interrupted(*_interrupt_after(["demo"], "cold run", tmp_path, settle=0.5))


def test_ctrl_c_during_verify_in_its_warm_process(tmp_path):
    store = f"lmdb://{tmp_path}/store?capacity=64MiB"
    _assert_interrupted(*_interrupt_after(["verify", "--store", store, "--restart"], "warm run", tmp_path, settle=0.2))


def test_ctrl_c_during_bench_vllm_ttft_stops_its_engines(tmp_path):
    out = ["--out", str(tmp_path / "results")]
    # while its engines start (each a process group of its own, vLLM's engine core inside)
    _assert_interrupted(*_interrupt_after(["bench", "vllm-ttft", "--quick", *out], "starting", tmp_path, settle=8.0))
