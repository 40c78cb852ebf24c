"""MXFP4 weights (gpt-oss's published expert weights), dequantised on load.

A weight `NAME` [..., R, C] (gpt-oss: `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, one
matrix per expert, rows = output channels) is stored as two uint8 tensors

    NAME_blocks  [..., R, C / 32, 16]   32 FP4 (E2M1) values per block, two per byte, low nibble first
    NAME_scales  [..., R, C / 32]       one E8M0 exponent per block: the block times 2 ** (scale - 127)

and read as float [..., C, R]: the last two axes swapped, the layout transformers' GptOssExperts
holds (`gate_up_proj` [E, H, 2F], `down_proj` [E, F, H]) and saves unquantised. This is the
dequantisation of transformers' `integrations/mxfp4.py` (`convert_moe_packed_tensors`).
`SafetensorsFiles` (checkpoints/hf.py) pairs the two tensors and dequantises on read, so a
loader sees `NAME` as a float tensor.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: the stored byte minus 127 is the power of two

# The 16 FP4 (E2M1) codes: bit 3 the sign, bits 0-2 the magnitude.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., C, R] of blocks uint8 [..., R, C/32, 16] and scales uint8 [..., R, C/32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair: blocks must be "
            f"scales' shape + ({BLOCK // 2},)."
        )
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., G, 16, 2]
    values = values.reshape(*scales.shape, BLOCK)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of a float [..., C, R] (C a multiple of 32), the inverse layout of
    `dequantize_mxfp4`. Each block's exponent is floor(log2(max |x|)) - 2, so its largest value
    lands in FP4's top binade [4, 6]; values round to the nearest FP4 value (ties to the smaller
    magnitude) and saturate at +-6."""
    rows = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., R, C]
    if rows.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input axis to be a multiple of {BLOCK}, got {rows.shape[-1]}.")
    grouped = rows.reshape(*rows.shape[:-1], rows.shape[-1] // BLOCK, BLOCK)
    peak = np.max(np.abs(grouped), axis=-1)
    exponent = np.where(peak > 0, np.floor(np.log2(np.where(peak > 0, peak, 1.0))) - 2, 0)
    exponent = np.clip(exponent, -SCALE_BIAS, 254 - SCALE_BIAS).astype(np.int32)  # 255 is NaN
    scaled = grouped / np.ldexp(np.float32(1), exponent)[..., None]
    magnitudes = FP4_VALUES[:8]
    codes = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1)  # ties: the first
    codes = (codes | (np.signbit(scaled) << 3)).astype(np.uint8)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)


def mxfp4_names(dtypes: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """{weight: (its blocks tensor, its scales tensor)} among a file's tensors, given
    {name: safetensors dtype}: every uint8 `NAME_blocks` with a uint8 `NAME_scales`."""
    out = {}
    for name, dtype in dtypes.items():
        if name.endswith(BLOCKS_SUFFIX) and dtype == "U8":
            weight = name[: -len(BLOCKS_SUFFIX)]
            if dtypes.get(weight + SCALES_SUFFIX) == "U8":
                out[weight] = (name, weight + SCALES_SUFFIX)
    return out


def mxfp4_float_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The float shape [..., C, R] a blocks tensor [..., R, C/32, 16] reads as."""
    *prefix, rows, groups, _ = blocks_shape
    return (*prefix, groups * BLOCK, rows)
