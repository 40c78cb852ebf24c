"""Quantized weights in safetensors files (how spec_jax ships its drafters).

A float matrix `NAME` [out, in] (HF layout: one row per output channel; an embedding table's rows
are its tokens) is stored as one of

    int8, one scale per row:   NAME int8 [out, in],        NAME_scale float32 [out, 1]
    int4, one scale per group: NAME uint8 [out, in // 2],  NAME_scale float32 [out, in // group]
                               (two weights per byte, low nibble first, each stored as q + 8)

with NAME ~= q * scale, scale = max |row or group| / 127 (int8) or / 7 (int4). `SafetensorsFiles`
(checkpoints/hf.py) pairs a quantized tensor with its `_scale`, reports its float shape and
dequantizes on read, so every checkpoint loader reads such a file as a float one. Vectors (norms)
and integer tensors (vocabulary maps) are stored as they are.
"""

from __future__ import annotations

import os
from typing import Collection, Mapping

import numpy as np

from spec_jax.checkpoints.atomic import atomic_path

SCALE_SUFFIX = "_scale"
INT4_GROUP = 32
_LEVELS = {"int8": 127, "int4": 7}


def quantize(w: np.ndarray, bits: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """(stored tensor, float32 scale) of a float matrix [out, in] (see the module docstring)."""
    w = np.asarray(w, np.float32)
    out, width = w.shape
    group = width if bits == "int8" else INT4_GROUP
    if width % group or (bits == "int4" and width % 2):
        raise ValueError(f"cannot store a [{out}, {width}] matrix as {bits} in groups of {group}.")
    grouped = w.reshape(out, width // group, group)
    peak = np.max(np.abs(grouped), axis=-1, keepdims=True)
    scale = np.where(peak > 0, peak / _LEVELS[bits], 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scale), -_LEVELS[bits], _LEVELS[bits]).reshape(out, width)
    if bits == "int8":
        return q.astype(np.int8), scale[..., 0]
    nibbles = (q + 8).astype(np.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scale[..., 0]


def dequantize(stored: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 matrix of a stored tensor and its scale (the layout follows from its dtype)."""
    if stored.dtype == np.uint8:  # int4, two per byte
        q = np.stack([stored & 0xF, stored >> 4], axis=-1).reshape(stored.shape[0], -1).astype(np.int8) - 8
    else:
        q = stored
    groups = q.reshape(q.shape[0], scale.shape[1], -1).astype(np.float32)
    return (groups * np.asarray(scale, np.float32)[..., None]).reshape(q.shape)


def quantize_tensors(
    tensors: Mapping[str, np.ndarray], int4: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """Every float matrix as int8 (the names in `int4` as int4) + `_scale`; the rest unchanged."""
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        w = np.asarray(w)
        is_float = np.issubdtype(w.dtype, np.floating) or w.dtype.name == "bfloat16"
        if w.ndim == 2 and is_float:
            out[name], out[name + SCALE_SUFFIX] = quantize(w, "int4" if name in int4 else "int8")
        else:
            out[name] = w
    return out


def quantized_names(dtypes: Mapping[str, str]) -> dict[str, str]:
    """{quantized tensor: its scale tensor} among a file's tensors, given {name: safetensors dtype}."""
    return {
        name[: -len(SCALE_SUFFIX)]: name
        for name in dtypes
        if name.endswith(SCALE_SUFFIX) and dtypes.get(name[: -len(SCALE_SUFFIX)]) in ("I8", "U8")
    }


def float_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The float matrix's shape of a stored quantized tensor."""
    return (shape[0], shape[1] * 2) if dtype == "U8" else shape


def quantize_checkpoint_file(path: str | os.PathLike, int4: Collection[str] = ()) -> None:
    """Rewrite a model.safetensors in place with its float matrices quantized (`quantize_tensors`)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    unknown = set(int4) - set(tensors)
    if unknown:
        raise ValueError(f"{path} has no tensor {sorted(unknown)} to store as int4.")
    if any(w.dtype in (np.int8, np.uint8) and name + SCALE_SUFFIX in tensors for name, w in tensors.items()):
        raise ValueError(f"{path} is already quantized; quantize the float checkpoint it came from.")
    metadata["spec_jax_weights"] = "quantized, see spec_jax.checkpoints.quantized"
    with atomic_path(path) as tmp:
        save_file(quantize_tensors(tensors, int4), str(tmp), metadata=metadata)
