"""GLM-5.3-Flash model configuration: the fields the bundled runner needs, read from an HF config.json.

The runner must agree with the HF reference (`Glm5NextTextConfig`) on every derived schedule, so the
defaulting rules for `layer_types`, `mlp_layer_types`, `indexer_types` and `linear_attn_config` are
reproduced here; `to_hf_dict` goes the other way so tests can build the HF oracle from the same config.
A cache block size is deliberately absent: it belongs to the paged cache, not to the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from kvoffload.errors import ConfigError

KDA = "linear_attention"
MLA = "indexed_attention"
_LAYER_TYPES = (KDA, MLA)
_MLP_TYPES = ("dense", "sparse")
_INDEXER_TYPES = ("full", "shared")
_DTYPES = ("float32", "bfloat16", "float16")
_FROM_ZERO = ("qk_rope_head_dim", "n_shared_experts", "num_nextn_predict_layers", "pad_token_id")  # other ints: >= 1
_KINDS = {
    "int": (int, "an integer"),
    "float": (float, "a number"),
    "bool": (bool, "true or false"),
    "str": (str, "a string"),
}


class ModelConfigError(ConfigError):
    """A config.json or checkpoint file the runner cannot use: the user's to fix, not a bug."""


def _checked(name: str, value, kind: str):
    """`value` if it is of `kind` ('int', 'float', ...; an int is a float, a bool is neither): a config
    written by hand must fail here, by name, not deep inside torch."""
    want, words = _KINDS[kind]
    if want is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float) if want is float else want) and not isinstance(value, bool)
        ok = ok and not (want is float and not math.isfinite(value))
    if not ok:
        raise ModelConfigError(f"{name} must be {words}, got {value!r}")
    return value


def _names(name: str, value):
    if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
        raise ModelConfigError(f"{name} must be a list of names, got {value!r}")
    return value


@dataclass(frozen=True)
class GlmConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    # MLA (NoPE) attention
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # DSA indexer with k-pool compression
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    # KDA linear attention
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None
    # feed-forward
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    # manifold-constrained hyper-connections
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float
    dtype: str
    pad_token_id: int | None
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            object.__setattr__(self, name, tuple(_names(name, getattr(self, name))))
        self._validate()

    def _validate(self) -> None:
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.type.removesuffix(" | None")
            if kind in _KINDS and not (value is None and f.type.endswith("| None")):
                _checked(f.name, value, kind)
                low = 0 if f.name in _FROM_ZERO else 1
                if kind == "int" and value < low:
                    raise ModelConfigError(f"{f.name} must be {('non-negative', 'positive')[low]}, got {value}")
        n = self.num_hidden_layers
        if self.qk_rope_head_dim != 0:
            raise ModelConfigError(
                f"qk_rope_head_dim must be 0 (GLM-5.3-Flash MLA is NoPE), got {self.qk_rope_head_dim}"
            )
        if self.index_topk % self.index_kpool != 0:
            raise ModelConfigError(
                f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})"
            )
        for name, allowed in (
            ("layer_types", _LAYER_TYPES),
            ("mlp_layer_types", _MLP_TYPES),
            ("indexer_types", _INDEXER_TYPES),
        ):
            values = getattr(self, name)
            if len(values) != n:
                raise ModelConfigError(f"{name} has {len(values)} entries for {n} layers")
            bad = sorted(set(values) - set(allowed))
            if bad:
                raise ModelConfigError(f"{name} has unknown values {bad}; allowed: {list(allowed)}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ModelConfigError(f"num_nextn_predict_layers must be 0 or 1, got {self.num_nextn_predict_layers}")
        if self.tie_word_embeddings:
            raise ModelConfigError("tie_word_embeddings=True is not supported: GLM-5.3-Flash has its own lm_head")
        if self.n_routed_experts % self.n_group != 0 or not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(
                f"bad expert grouping: {self.n_routed_experts} experts, n_group {self.n_group}, "
                f"topk_group {self.topk_group}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ModelConfigError(f"num_experts_per_tok {self.num_experts_per_tok} > {self.n_routed_experts} experts")
        if self.dtype not in _DTYPES:
            raise ModelConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        full_mla = [i for i in self.mla_layers if self.indexer_types[i] == "full"]
        for i in self.mla_layers:
            if self.indexer_types[i] == "shared" and not any(j < i for j in full_mla):
                raise ModelConfigError(f"layer {i} reuses top-k indices but no earlier indexed layer runs its indexer")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    # ---- HF interop -------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict) -> GlmConfig:
        """Build from a text config dict, or a multimodal config with `text_config` (vision is ignored)."""
        if not isinstance(d, dict):
            raise ModelConfigError(f"a config is a JSON object, got {type(d).__name__}")
        if isinstance(d.get("text_config"), dict):
            outer = d
            d = dict(d["text_config"])
            for key in ("dtype", "torch_dtype", "num_nextn_predict_layers", "tie_word_embeddings"):
                if key not in d and key in outer:
                    d[key] = outer[key]

        def get(key, default):  # typed like its default
            return _checked(key, d[key], type(default).__name__) if d.get(key) is not None else default

        def names(key):
            return None if d.get(key) is None else _names(key, d[key])

        n = get("num_hidden_layers", 45)
        layer_types = names("layer_types")
        if layer_types is None:
            layer_types = [KDA if i % 4 != 3 else MLA for i in range(n)]
        layer_types = [MLA if t == "full_attention" else t for t in layer_types]
        mlp_layer_types = names("mlp_layer_types")
        if mlp_layer_types is None:
            mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        indexer_types = names("indexer_types")
        if indexer_types is None:
            pattern = d.get("index_topk_pattern")
            if isinstance(pattern, str):  # an unknown letter is reported as an unknown indexer type
                indexer_types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            elif pattern is not None:
                indexer_types = names("index_topk_pattern")
            else:
                freq = max(get("index_topk_freq", 1), 1)
                offset = get("index_skip_topk_offset", 2)
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]

        linear = {
            "linear_num_heads": get("linear_num_heads", 64),
            "linear_head_dim": get("linear_head_dim", 128),
            "linear_conv_kernel_dim": get("linear_conv_kernel_dim", 4),
            "linear_lower_bound": d.get("linear_lower_bound", -5.0),
        }
        if isinstance(lac := d.get("linear_attn_config"), dict):
            linear["linear_head_dim"] = lac.get("head_dim", linear["linear_head_dim"])
            linear["linear_num_heads"] = lac.get("num_heads", linear["linear_num_heads"])
            linear["linear_conv_kernel_dim"] = lac.get("short_conv_kernel_size", linear["linear_conv_kernel_dim"])
            linear["linear_lower_bound"] = lac.get("gate_lower_bound", linear["linear_lower_bound"])
            if lac.get("safe_gate", True) and linear["linear_lower_bound"] is None:
                linear["linear_lower_bound"] = -5.0

        if get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act must be 'silu', got {d['hidden_act']!r}")
        if get("attention_bias", False):
            raise ModelConfigError("attention_bias=True is not supported (GLM-5.3-Flash has none)")
        heads = get("num_attention_heads", 64)
        if get("num_key_value_heads", heads) != heads:
            raise ModelConfigError(
                f"num_key_value_heads ({d['num_key_value_heads']}) must equal num_attention_heads ({heads})"
            )
        if d.get("q_lora_rank", 1536) is None:
            raise ModelConfigError("q_lora_rank is required (the DSA indexer reads the q latent)")

        dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
        return cls(
            vocab_size=get("vocab_size", 154880),
            hidden_size=get("hidden_size", 4096),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),  # __post_init__ checks the names
            mlp_layer_types=tuple(mlp_layer_types),
            indexer_types=tuple(indexer_types),
            num_attention_heads=heads,
            q_lora_rank=get("q_lora_rank", 1536),
            kv_lora_rank=get("kv_lora_rank", 512),
            qk_nope_head_dim=get("qk_nope_head_dim", 256),
            qk_rope_head_dim=get("qk_rope_head_dim", 0),
            v_head_dim=get("v_head_dim", 256),
            index_n_heads=get("index_n_heads", 32),
            index_head_dim=get("index_head_dim", 128),
            index_topk=get("index_topk", 2048),
            index_kpool=get("index_kpool", 16),
            index_kpool_always_select_tail=bool(get("index_kpool_always_select_tail", True)),
            **linear,
            intermediate_size=get("intermediate_size", 12288),
            moe_intermediate_size=get("moe_intermediate_size", 2048),
            n_routed_experts=get("n_routed_experts", get("num_local_experts", 288)),
            num_experts_per_tok=get("num_experts_per_tok", 8),
            n_shared_experts=get("n_shared_experts", 1),
            n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            hc_mult=get("hc_mult", 4),
            hc_eps=float(get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            dtype=dtype,
            pad_token_id=d.get("pad_token_id", 154820),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> GlmConfig:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(file, "rb") as f:
            try:
                d = json.load(f)
            except ValueError as exc:  # not JSON, or not text at all
                raise ModelConfigError(f"{file}: not valid JSON ({exc})") from None
        try:
            return cls.from_hf_dict(d)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{file}: {exc}") from None

    def to_hf_dict(self) -> dict:
        """A text config dict that `Glm5NextTextConfig(**d)` accepts and `from_hf_dict` inverts."""
        d = dataclasses.asdict(self)
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            d[name] = list(d[name])
        d.update(
            model_type="glm5_next_text",
            architectures=["Glm5NextTextModel"],
            num_key_value_heads=self.num_attention_heads,
            hidden_act="silu",
            attention_bias=False,
        )
        return d

    def replace(self, **changes) -> GlmConfig:
        return dataclasses.replace(self, **changes)


def _full() -> GlmConfig:
    # HF defaults, except index_kpool: the shipped checkpoint uses 4 (HF's default is 16).
    return GlmConfig.from_hf_dict({"index_kpool": 4, "dtype": "bfloat16", "num_nextn_predict_layers": 1})


def _pruned_4l() -> GlmConfig:
    full = _full()
    return full.replace(
        num_hidden_layers=4,
        layer_types=full.layer_types[:4],
        mlp_layer_types=full.mlp_layer_types[:4],
        indexer_types=full.indexer_types[:4],
    )


def _vllm_4l() -> GlmConfig:
    # For vLLM's own glm5next on one GPU (~1.2 GiB in bf16): the first four layers of the full model
    # (KDA, KDA, KDA, MLA; dense, dense, dense, MoE) at the full attention, DSA indexer, KDA and mHC
    # widths, with what only costs memory cut down: 8 small routed experts (top-2), narrow dense MLPs,
    # a 4096-token vocabulary and no MTP layer.
    return _pruned_4l().replace(
        vocab_size=4096,
        pad_token_id=None,
        intermediate_size=1024,
        moe_intermediate_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_nextn_predict_layers=0,
    )


def _tiny() -> GlmConfig:
    # The structural toy: every block kind of the full model (MLA, DSA indexer, kpool tail, KDA, MoE),
    # small enough for 2 CPU cores.
    return GlmConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=5,
        layer_types=(KDA, KDA, MLA, KDA, MLA),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse", "sparse"),
        indexer_types=("full",) * 5,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=0,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=16,
        index_kpool=4,
        index_kpool_always_select_tail=True,
        linear_num_heads=4,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        swiglu_limit=10.0,
        hc_mult=4,
        hc_eps=1e-6,
        hc_sinkhorn_iters=20,
        rms_norm_eps=1e-5,
        dtype="float32",
        pad_token_id=None,
        num_nextn_predict_layers=0,
    )


PRESETS = {"tiny": _tiny, "full": _full, "pruned-4l": _pruned_4l, "vllm-4l": _vllm_4l}


def preset(name: str) -> GlmConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ModelConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
