"""The documentation runs: every fenced code block of README.md and docs/*.md.

- ```python blocks run in a fresh interpreter (this one's), ```bash blocks with `bash -euo pipefail`,
  each in a sandbox: the working directory is a temporary one holding a `.venv` link to the environment
  running the tests (so `. .venv/bin/activate` enters it), XDG_CACHE_HOME is a temporary directory (so
  default stores and models land there), PYTHONPATH is this checkout and the environment's `bin` comes
  first on PATH (`python`, `kvoffload`, `vllm`). Each must exit 0.
- Blocks that cannot run on a 2-core CPU machine without a GPU are listed in NOT_RUN by their first
  line, with the reason; they are still checked: `bash -n`, and every connector JSON in them parses and
  names KVOffloadConnector, its module path and valid `kv_connector_extra_config`.
- The README's CPU vLLM recipe runs for real (two `vllm serve` processes one after the other, on a free
  port, in the test's directory): the second server's completion must equal the first's and its prompt
  tokens must come from the store.
- ```text and ```console blocks are output, not run. Any other block -- no language, another language,
  a python or bash block neither run nor listed -- fails `test_every_block_is_run_or_listed`, so a new
  block is tested from the day it is written.
Also: the README stays short, names every benchmark and every connector key, and links resolve.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("python", "bash")
OUTPUT = ("text", "console")
TIMEOUT = 240  # seconds per block; the slowest ones take well under that on 2 cores

# First line of a block -> why it cannot run on a CPU CI machine.
NOT_RUN = {
    "make demo   # tiny GLM-5.3-Flash: cold run, offload to LMDB, restart, warm run from disk, verify, report": (
        "builds the environment (minutes, network); CI runs `make demo` and `make test` themselves"
    ),
    "pip install vllm==0.34.0 -e .                          # in the clone: the CUDA wheel, then kvoffload": (
        "the GPU recipe: vLLM's CUDA wheel, a GPU and GLM-5.3-Flash's weights"
    ),
    "vllm serve zai-org/GLM-5.3-Flash --enable-prefix-caching \\": "GLM-5.3-Flash on GPUs (306 GB of weights)",
    'kvoffload verify --device cuda --restart --store "lmdb://$PWD/verify-store?capacity=1GiB"': (
        "needs a GPU, and a Redis server for --separate"
    ),
    "kvoffload bench datapath": "GPU benchmarks, at full size (minutes each)",
    "make test PYTEST_ARGS=\"-m 'not slow'\"                   # a quick loop": (
        "runs the test suite itself, and make may rebuild the environment"
    ),
}
# The README's CPU vLLM recipe: run with its port and /tmp paths replaced, then checked (below).
CPU_RECIPE = ". .venv/bin/activate                                   # the environment `make demo` built"
# Blocks that take more than a few seconds.
SLOW = {"kvoffload demo                                          # the job behind `make demo`"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.splitlines()[0].rstrip() if self.code.strip() else ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found, lines, at = [], path.read_text().splitlines(), 0
    while at < len(lines):
        opening = re.fullmatch(r"```(\S*)\s*", lines[at])
        if opening is None:
            at += 1
            continue
        end = next((i for i in range(at + 1, len(lines)) if lines[i].rstrip() == "```"), None)
        assert end is not None, f"{path.name}:{at + 1}: a code block is never closed"
        found.append(Block(path, at + 1, opening.group(1), "\n".join(lines[at + 1 : end]) + "\n"))
        at = end + 1
    return found


ALL = [b for path in DOCS for b in blocks(path)]
RUNNABLE = [b for b in ALL if b.lang in RUN and b.first not in NOT_RUN and b.first != CPU_RECIPE]
LISTED = [b for b in ALL if b.first in NOT_RUN]


def _param(block: Block):
    marks = [pytest.mark.slow] if block.first in SLOW else []
    return pytest.param(block, id=block.name, marks=marks)


def test_every_block_is_run_or_listed():
    problems = [
        f"{b.name}: ```{b.lang or '(no language)'} is neither run (python, bash) nor output (text, console)"
        for b in ALL
        if b.lang not in RUN + OUTPUT
    ]
    problems += [f"{b.name}: a {b.lang} block listed in NOT_RUN" for b in LISTED if b.lang != "bash"]
    for first in [*NOT_RUN, CPU_RECIPE, *SLOW]:
        matching = [b.name for b in ALL if b.first == first and b.lang in RUN]
        if len(matching) != 1:
            problems.append(f"{first!r} starts {len(matching)} blocks ({matching}), not exactly one")
    assert not problems, "\n".join(problems)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_block(lang: str, code: str, where: Path, timeout: float = TIMEOUT) -> str:
    """Run `code` in the sandbox in `where`; its stdout (stderr is shown on failure)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / ".venv").symlink_to(sys.prefix)
    script = where / ("block.py" if lang == "python" else "block.sh")
    script.write_text(code)
    command = [sys.executable, script.name] if lang == "python" else ["bash", "-euo", "pipefail", script.name]
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        XDG_CACHE_HOME=str(where / "cache"),
        PYTHONPATH=str(ROOT),
        PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    proc = subprocess.Popen(
        command, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    finally:  # what the block left running (a server it stopped may still be on its way out)
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    return out


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_block_runs(block: Block, tmp_path):
    run_block(block.lang, block.code, tmp_path / "sandbox")


def connector_configs(code: str) -> list[dict]:
    """Every single-quoted JSON object in a shell block that names a KV connector."""
    return [json.loads(text) for text in re.findall(r"'(\{[^']*\})'", code) if '"kv_connector"' in text]


@pytest.mark.parametrize("block", [_param(b) for b in LISTED])
def test_listed_block_is_valid_shell(block: Block):
    checked = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("block", [_param(b) for b in ALL if b.lang == "bash" and "--kv-transfer-config" in b.code])
def test_connector_json(block: Block):
    from kvoffload.connectors.vllm_config import ConnectorConfig

    configs = connector_configs(block.code)
    assert configs, "--kv-transfer-config without a connector JSON in single quotes"
    for config in configs:
        assert config["kv_connector"] == "KVOffloadConnector"
        assert config["kv_connector_module_path"] == "kvoffload.connectors.vllm"
        assert config["kv_role"] == "kv_both"
        ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))  # keys known, store URL valid


@pytest.mark.slow
def test_cpu_vllm_recipe(tmp_path):
    """The README's CPU recipe, run as written but on a free port and under this test's directory."""
    (block,) = [b for b in ALL if b.first == CPU_RECIPE]
    assert block.code.count("/tmp/kvoffload-") >= 4 and "8765" in block.code
    code = block.code.replace("8765", str(_free_port())).replace("/tmp/kvoffload-", f"{tmp_path}/kvoffload-")
    try:
        out = run_block("bash", code, tmp_path / "sandbox", timeout=540)
    except BaseException:
        log = tmp_path / "kvoffload-vllm.log"
        print(log.read_text()[-5000:] if log.exists() else "no vLLM log")
        raise
    lines = out.splitlines()
    completions = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(completions) == 2, out
    cold, warm = (c["choices"][0]["token_ids"] for c in completions)
    assert cold and len(cold) == 8 and warm == cold, (cold, warm)
    assert all(c["usage"]["prompt_tokens"] == 300 for c in completions)
    (metric,) = [line for line in lines if "prompt_tokens_by_source" in line]
    assert 'source="external_kv_transfer"' in metric
    assert float(metric.split()[-1]) > 0, f"no prompt token came from the store: {metric}"


def test_readme_and_benchmarks_are_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400


def test_every_benchmark_is_named():
    from kvoffload.cli import BENCHMARKS

    shown = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},
    )
    assert shown.returncode == 0, shown.stderr
    assert len(BENCHMARKS) == 15
    for where, text in [
        ("README.md", (ROOT / "README.md").read_text()),
        ("docs/benchmarks.md", (ROOT / "docs/benchmarks.md").read_text()),
        ("docs/cli.md", (ROOT / "docs/cli.md").read_text()),
        ("kvoffload bench --help", shown.stdout),
    ]:
        missing = [name for name in BENCHMARKS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]
        assert not missing, f"{where} does not name {missing}"
    table = (ROOT / "docs/benchmarks.md").read_text()
    assert all(f"| `{name}` |" in table for name in BENCHMARKS), "a benchmark without a row in docs/benchmarks.md"


def test_every_connector_key_is_documented():
    from kvoffload.connectors.vllm_config import EXTRA_CONFIG_KEYS

    for doc in ("README.md", "docs/vllm.md"):
        text = (ROOT / doc).read_text()
        rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
        assert set(EXTRA_CONFIG_KEYS) <= rows, f"{doc} lacks {sorted(set(EXTRA_CONFIG_KEYS) - rows)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    anchors = {
        path: {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
        for path in DOCS
    }
    problems = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                problems.append(f"{path.name}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors.get(linked, set()):
                problems.append(f"{path.name}: {target}: no such heading")
    assert not problems, "\n".join(problems)
