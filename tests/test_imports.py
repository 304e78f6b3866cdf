"""The import structure: no circle among kvoffload's modules (lazy imports included), and the core
(`spec`, `store`, `connectors`) never imports up into the proof, the demo, the benchmarks or the CLI."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent  # tests/ -> the repository root
CORE = ("kvoffload.spec", "kvoffload.store", "kvoffload.connectors")
ABOVE = ("kvoffload.tools.bench", "kvoffload.tools.harness", "kvoffload.tools", "kvoffload.cli", "kvoffload.tools.demo", "kvoffload.tools.verify",
         "glm_integration")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (ROOT / "kvoffload").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The kvoffload modules `name` imports anywhere in its body (a package's submodule when named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known or t.startswith("glm_integration"))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_import_circles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(nxt_ := node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt in graph and nxt not in state:
                visit(nxt, stack + [nxt])
        state[nxt_] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_never_imports_up():
    up = {(name, target) for name, targets in _graph().items() if name.startswith(CORE)
          for target in targets if target.startswith(ABOVE)}
    assert not up, f"the core imports the layers above it: {sorted(up)}"


def test_the_vllm_plugin_imports_nothing_heavy():
    """vLLM imports its plugins in every process: the plugin module loads no store stack (numpy, lmdb,
    xxhash), no torch and no vLLM until `register()` runs; `kvoffload`'s names still import on use."""
    code = ("import sys, kvoffload.connectors.vllm_plugin; "
            "print(sorted(m for m in ('numpy', 'lmdb', 'xxhash', 'torch', 'vllm') if m in sys.modules)); "
            "import kvoffload, kvoffload.connectors; kvoffload.open_store, kvoffload.connectors.Offloader; "
            "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout


def test_the_library_and_the_vllm_connector_load_no_tools_and_no_runner():
    """`import kvoffload`, the vLLM plugin's `register()` and the connector module vLLM loads bring in
    neither the tools (proof, demo, benchmarks, engine harness) nor the bundled GLM runner."""
    code = ("import sys, kvoffload, kvoffload.connectors, kvoffload.store; "
            "import kvoffload.connectors.vllm_plugin as plugin; plugin.register(); "
            "import kvoffload.connectors.vllm; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvoffload.tools', 'glm_integration'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
