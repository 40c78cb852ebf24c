"""Frozen decoder configs that map to and from HF `config.json`.

Llama (SmolLM2, Llama 3.x) and Qwen3 are configs of the same decoder: Qwen3 adds per-head q/k
RMSNorm, an explicit head_dim and optional sliding-window layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}

GLOBAL_WINDOW = 1 << 30

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """KV-cache bytes one token takes: a key and a value per KV head in every layer."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_ITEMSIZE)}.")
    return 2 * num_layers * num_kv_heads * head_dim * _ITEMSIZE[dtype]  # "no sliding window": larger than any cache capacity


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x `rope_type: llama3` frequency scaling (the only scaling the supported models use)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of one decoder. Hashable, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qk_norm: bool = False
    # Per-layer attention window in tokens; GLOBAL_WINDOW for full attention.
    layer_windows: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (GLOBAL_WINDOW,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries but the model has "
                f"{self.num_layers} layers; give one window per layer."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups."
            )

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- HF mapping
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], dtype: str = "float32") -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = None
        for name in archs:
            arch = SUPPORTED_ARCHITECTURES.get(name, arch)
        if arch is None and model_type in ("llama", "qwen3"):
            arch = model_type
        if arch is None:
            raise ValueError(
                f"Unsupported architecture {archs or model_type!r}: spec_jax supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type llama or qwen3). Convert the model or "
                "pick a supported target."
            )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_layers = hf["num_hidden_layers"]
        rope_scaling = None
        # transformers >= 5 writes `rope_parameters` (theta included); older files `rope_scaling`.
        rs = hf.get("rope_parameters") or hf.get("rope_scaling") or None
        rope_theta = float((rs or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
        if rs:
            rope_type = rs.get("rope_type", rs.get("type"))
            if rope_type == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif rope_type not in (None, "default"):
                raise ValueError(
                    f"Unsupported rope_scaling type {rope_type!r}; spec_jax implements 'llama3' only."
                )
        windows = layer_windows_from_hf(hf, num_layers)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            layer_windows=windows,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            dtype=dtype,
        )

    def to_hf_config(self) -> dict[str, Any]:
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        hf: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        if any(w != GLOBAL_WINDOW for w in self.layer_windows):
            window = next(w for w in self.layer_windows if w != GLOBAL_WINDOW)
            hf["sliding_window"] = window
            hf["use_sliding_window"] = True
            hf["layer_types"] = [
                "full_attention" if w == GLOBAL_WINDOW else "sliding_attention"
                for w in self.layer_windows
            ]
            hf["max_window_layers"] = self.num_layers
        return hf


def layer_windows_from_hf(hf: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Per-layer attention windows from HF `layer_types` / `sliding_window` fields."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        # Qwen3 without layer_types: sliding layers only when use_sliding_window is set, for the
        # layers at or past max_window_layers (as transformers derives layer_types).
        if hf.get("use_sliding_window") and window:
            mwl = hf.get("max_window_layers", num_layers)
            layer_types = [
                "sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)
            ]
        else:
            layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers; fix config.json."
        )
    windows = []
    for kind in layer_types:
        if kind == "sliding_attention":
            if not window:
                raise ValueError("layer_types names a sliding_attention layer but sliding_window is unset.")
            windows.append(int(window))
        else:
            windows.append(GLOBAL_WINDOW)
    return tuple(windows)
