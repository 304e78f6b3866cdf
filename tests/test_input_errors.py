"""Bad input to `kvoffload verify` (prompt files, checkpoints, config.json, options) is one line on
stderr and exit status 2, never a traceback; and a bug is not passed off as bad input."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import subprocess_env
from glm_integration.config import GlmConfig, ModelConfigError, preset


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def _refused(out, *messages):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    for message in messages:
        assert message in out.stderr, out.stderr


def _one_line(out, *messages):
    _refused(out, *messages)
    assert out.stderr.startswith("kvoffload: ") and out.stderr.count("\n") == 1, out.stderr


@pytest.fixture
def model(tmp_path, tiny_checkpoint):
    """A copy of the tiny checkpoint, to break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "model")


def _verify(model, *args):
    return _run("verify", "--model", str(model), "--quiet", *args)


# -- prompt files ------------------------------------------------------------------------------------

def test_prompts_that_are_a_directory_or_missing(tmp_path, tiny_checkpoint):
    _one_line(_verify(tiny_checkpoint, "--prompts", str(tmp_path)), str(tmp_path), "Is a directory")
    _one_line(_verify(tiny_checkpoint, "--prompts", str(tmp_path / "none.txt")), "none.txt", "No such file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_prompts_that_cannot_be_read(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n")
    prompts.chmod(0)
    _one_line(_verify(tiny_checkpoint, "--prompts", str(prompts)), "Permission denied")


@pytest.mark.parametrize("content, message", [
    ("1 2 x\n", "prompts.txt:1: a prompt is space-separated token ids"),
    ("1 2\n3 4.5\n", "prompts.txt:2: a prompt is space-separated token ids"),
    ("1 2 512\n", "prompts.txt:1: token id 512 is outside the model's vocabulary [0, 512)"),
    ("1 -1 2\n", "prompts.txt:1: token id -1 is outside"),
    (b"\xff\xfe1 2\n", "prompts.txt: not a text file"),
    ("\n  \n", "prompts.txt: no prompts"),
])
def test_prompts_with_bad_tokens(tmp_path, tiny_checkpoint, content, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content if isinstance(content, bytes) else content.encode())
    _one_line(_verify(tiny_checkpoint, "--prompts", str(prompts)), message)


# -- checkpoints ---------------------------------------------------------------------------------------

def test_safetensors_that_is_garbage_or_truncated(model):
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(os.urandom(100))
    _one_line(_verify(model), "model.safetensors: not a readable safetensors file")
    weights.write_bytes(data[: len(data) // 2])
    _one_line(_verify(model), "model.safetensors: not a readable safetensors file")
    weights.unlink()
    _one_line(_verify(model), "no weight files (*.safetensors")


@pytest.mark.parametrize("index, message", [("{", "not valid JSON"), ('{"weight_map": [1]}', "no weight_map")])
def test_shard_index_that_is_not_an_index(model, index, message):
    from glm_integration.weights import load_weights

    (model / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelConfigError, match="model.safetensors.index.json: " + message):
        load_weights(str(model))


def test_bad_checkpoint_found_by_a_phase_in_its_own_process(tmp_path, model):
    (model / "model.safetensors").write_bytes(os.urandom(100))
    _one_line(_verify(model, "--separate", "--store", f"lmdb://{tmp_path}/store?capacity=1MiB"),
              "model.safetensors: not a readable safetensors file")


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": "abc"}, "vocab_size must be an integer, got 'abc'"),
    ({"vocab_size": 0}, "vocab_size must be positive, got 0"),
    ({"hidden_size": -128}, "hidden_size must be positive, got -128"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer, got 2.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),
    ({"layer_types": 5}, "layer_types must be a list of names, got 5"),
    ({"layer_types": ["linear_attention", 3, "indexed_attention", "linear_attention", "indexed_attention"]},
     "layer_types must be a list of names"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a number, got 'tiny'"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false, got 'false'"),
    ({"dtype": 5}, "dtype must be one of"),
    ({"index_topk_pattern": "FFFFX", "indexer_types": None}, "indexer_types has unknown values"),
    ({"index_topk_freq": "x", "indexer_types": None}, "index_topk_freq must be an integer"),
    ({"linear_attn_config": {"head_dim": "big"}}, "linear_head_dim must be an integer, got 'big'"),
    ({"pad_token_id": -1}, "pad_token_id must be non-negative"),
])
def test_config_json_with_wrong_types_or_sizes(tmp_path, change, message):
    d = {**preset("tiny").to_hf_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelConfigError, match="config.json: " + message.replace("(", r"\(").replace("[", r"\[")):
        GlmConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1, 2]", "a JSON object"),
                                           ("\udcff", "not valid JSON")])
def test_config_json_that_is_not_a_json_object(tmp_path, text, message):
    (tmp_path / "config.json").write_bytes(text.encode(errors="surrogateescape"))
    with pytest.raises(ModelConfigError, match=message):
        GlmConfig.from_pretrained(str(tmp_path))


def test_config_json_errors_from_the_command(model):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": "abc"}))
    _one_line(_verify(model), "config.json: vocab_size must be an integer, got 'abc'")
    (model / "config.json").write_text("{not json")
    _one_line(_verify(model), "config.json: not valid JSON")
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))  # weights have 512 rows
    _one_line(_verify(model), "wrong shape")


def test_missing_model_and_unknown_preset(tmp_path):
    _one_line(_run("verify", "--quiet", "--model", str(tmp_path / "none")), "none", "No such file")
    _one_line(_run("verify", "--quiet", "--preset", "huge"), "unknown preset 'huge' (presets: tiny, full, pruned-4l")


# -- options -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, message", [
    ("--block-size", "0", "must be at least 1, got 0"),
    ("--block-size", "-16", "must be at least 1, got -16"),
    ("--block-size", "x", "not an integer: 'x'"),
    ("--max-tokens", "-1", "must be at least 1, got -1"),
    ("--max-tokens", "0", "must be at least 1, got 0"),
])
def test_counts_below_one(tiny_checkpoint, option, value, message):
    _refused(_verify(tiny_checkpoint, option, value), f"argument {option}: {message}")


def test_block_size_the_model_cannot_take(tiny_checkpoint):
    _one_line(_verify(tiny_checkpoint, "--block-size", "6"), "--block-size 6 must be a multiple of the model's "
                                                             "index_kpool (4)")


@pytest.mark.skipif(importlib.util.find_spec("aiter") is not None, reason="aiter is installed")
def test_kernels_not_installed(tiny_checkpoint):
    _one_line(_verify(tiny_checkpoint, "--kernels", "aiter"), "--kernels aiter: kernel backend 'aiter' is not")


@pytest.mark.parametrize("store, message", [
    ("memory://?capacity=" + "9" * 400, "memory capacity '999999"),
    ("lmdb:///proc/kvoffload/kv#1?capacity=1GiB", "%23"),
])
def test_store_errors_from_the_command(tiny_checkpoint, store, message):
    _one_line(_verify(tiny_checkpoint, "--store", store), message)


def test_a_bug_is_not_passed_off_as_bad_input(monkeypatch, tiny_checkpoint):
    """Only the input-error types are turned into exit status 2: any other ValueError is a traceback."""
    import kvoffload.tools.verify
    from kvoffload import cli

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(kvoffload.tools.verify, "verify", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        cli.main(["verify", "--model", tiny_checkpoint, "--quiet"])


def test_an_unreadable_file_is_one_line_even_as_root(monkeypatch, capsys):
    """(test_prompts_that_cannot_be_read is skipped as root, who reads anything.)"""
    import kvoffload.tools.verify
    from kvoffload import cli

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/prompts.txt")

    monkeypatch.setattr(kvoffload.tools.verify, "verify", denied)
    assert cli.main(["verify", "--quiet"]) == 2
    assert capsys.readouterr().err == "kvoffload: /data/prompts.txt: Permission denied\n"


# -- sizes: refused before anything large is allocated or written ------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--block-size", "100000000"], "--block-size 100000000 and --max-tokens 8 need about"),
    (["--max-tokens", "100000000"], "--block-size 16 and --max-tokens 100000000 need about"),
])
def test_sizes_that_cannot_fit_are_refused_at_once(tiny_checkpoint, flags, message):
    """What once grew to 23 GB until the kernel killed it: one line, exit 2, in seconds, memory small."""
    out = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, "-m", "kvoffload.cli", "verify",
                          "--model", str(tiny_checkpoint), "--quiet", *flags],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    rss = int(out.stderr.rsplit("maxrss_kb=", 1)[1])
    out.stderr = out.stderr.rsplit("maxrss_kb=", 1)[0].replace("Command exited with non-zero status 2\n", "")
    _one_line(out, message, "GiB available")
    assert rss < 1_500_000, rss


def test_a_large_preset_needs_yes_and_writes_nothing(tmp_path):
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "verify", "--preset", "full", "--quiet"], env=env,
                         capture_output=True, text=True, timeout=60)
    _one_line(out, "--preset full writes a 597.5 GiB random checkpoint", "pass --yes")
    assert not (tmp_path / "kvoffload" / "models").exists() or not os.listdir(tmp_path / "kvoffload" / "models")


def test_a_preset_larger_than_the_disk_is_refused_with_yes(tmp_path):
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "verify", "--preset", "full", "--yes", "--quiet"],
                         env=env, capture_output=True, text=True, timeout=60)
    if shutil.disk_usage(tmp_path).free > 700 << 30:
        pytest.skip("this disk has room for the full checkpoint")
    _one_line(out, "--preset full needs 597.5 GiB for its checkpoint", "GiB free")
    assert not os.listdir(tmp_path / "kvoffload" / "models")


def test_a_failed_checkpoint_write_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """A write that fails midway (a full disk, say) removes its `.tmp<pid>` folder."""
    import glm_integration.checkpoint as checkpoint
    from kvoffload.tools import verify

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def fail(config, seed, out_dir, **kwargs):
        os.makedirs(out_dir)
        (open(os.path.join(out_dir, "model.safetensors"), "wb")).write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_checkpoint", fail)
    with pytest.raises(verify.InputError, match="tiny: writing its checkpoint to .* failed: No space left"):
        verify.default_model_dir("tiny")
    assert os.listdir(tmp_path / "kvoffload" / "models") == []


# -- benchmark options -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["bench", "overhead", "--model", "llama-3.1-8b"], "bench overhead has no --model (those with one: vllm-ttft)"),
    (["bench", "vllm-ttft", "--model", "llama-3.1-8b"], "runs on a GPU only (--device cuda)"),
    (["bench", "store", "--device", "cuda"], "bench store has no --device"),
])
def test_a_benchmark_option_it_does_not_take_is_one_line(args, message, tmp_path):
    _one_line(_run(*args, "--out", str(tmp_path)), message)
    assert not list(tmp_path.iterdir())  # refused before anything ran
