"""Frozen-target features (the target never trains), computed once per dataset or per step.

For every token of every sequence: the target's hidden states after `capture_layers` (what a DFlash
drafter reads) and the target's final-normed hidden state (its logits are `lm_head` of it, so
distillation losses recompute teacher logits for just the positions they need).

Precomputing (`compute_features`) pays the target's forward pass once and reuses it every epoch,
but holds `tokens x (layers + 1) x hidden` values in host memory (only the first seq_len tokens of
each sequence, the ones training reads; float32, or bfloat16 at half the memory, which is what an
accelerator's bfloat16 target would hand the drafter anyway); `WithTargetFeatures` runs the
target inside each jitted training step instead (the choice for accelerators and large data).

With a `store` directory the precomputed features live on disk as memory-mapped .npy files: the
pass (half an hour for 2M tokens on a 2-core CPU) resumes where an interrupted one stopped, a
later run over the same target, data and settings reuses it, and host memory only caches them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import forward_hidden, init_cache
from spec_jax.training.data import TokenDataset, matching_manifest, write_json_atomic


@dataclasses.dataclass
class TargetFeatures:
    """captured [rows, n*H] and final [rows, H]: sequence i's first min(len, seq_len) tokens are
    rows offsets[i] .. offsets[i + 1]."""

    capture_layers: tuple[int, ...]
    captured: np.ndarray
    final: np.ndarray
    offsets: np.ndarray


def target_features(
    params: Any, cfg: ModelConfig, tokens: jax.Array, capture_layers: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """(captured [B, T, n*H], final [B, T, H]) of the target over `tokens` [B, T]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    final, captured, _ = forward_hidden(
        params, cfg, tokens, positions, init_cache(cfg, b, t), tuple(capture_layers)
    )
    if captured is None:
        captured = jnp.zeros((b, t, 0), final.dtype)
    return jax.lax.stop_gradient(captured), jax.lax.stop_gradient(final)


def jitted_target_features(cfg: ModelConfig, capture_layers: tuple[int, ...]):
    """`target_features` compiled for (params, tokens)."""
    return jax.jit(lambda params, tokens: target_features(params, cfg, tokens, capture_layers))


@dataclasses.dataclass(frozen=True)
class WithTargetFeatures:
    """A loss whose batch gets `captured` and `final` from the frozen target inside the step."""

    loss: Any
    target_cfg: ModelConfig
    capture_layers: tuple[int, ...]

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        captured, final = target_features(target_params, self.target_cfg, batch["tokens"], self.capture_layers)
        return self.loss(params, target_params, {**batch, "captured": captured, "final": final}, key)


def precompute_fits(
    num_tokens: int, capture_layers: Sequence[int], hidden: int, limit_gb: float = 4.0, bytes_per_value: int = 4
) -> bool:
    """Whether precomputed features of a dataset stay under `limit_gb` of host memory."""
    return num_tokens * (len(capture_layers) + 1) * hidden * bytes_per_value <= limit_gb * 2**30


STORE_MANIFEST = "features.json"
# Sequences between two saves of an on-disk pass: what an interruption can cost.
STORE_FLUSH_EVERY = 256


def store_key(params: Any, data: TokenDataset, capture_layers: Sequence[int], seq_len: int, dtype: Any) -> dict:
    """What a stored feature pass depends on: the target's weights, the token data, the layers,
    seq_len and the storage dtype (hashes, so a changed target or dataset never reuses features)."""
    weights = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
        weights.update(jax.tree_util.keystr(path).encode())
        weights.update(np.ascontiguousarray(leaf).tobytes())
    tokens = hashlib.sha256(np.ascontiguousarray(data.tokens, np.int32).tobytes())
    tokens.update(np.ascontiguousarray(data.offsets, np.int64).tobytes())
    return {
        "target_sha256": weights.hexdigest(),
        "data_sha256": tokens.hexdigest(),
        "capture_layers": [int(i) for i in capture_layers],
        "seq_len": int(seq_len),
        "dtype": np.dtype(dtype).name,
    }


def _open_store(store: Path, key: dict, shapes: dict[str, tuple[int, int]], dtype: Any):
    """(memmaps by name, viewed as dtype; sequences already done). A new store is created; one
    holding another pass's features is refused rather than overwritten."""
    # .npy has no bfloat16: it is stored as its uint16 bits and viewed back.
    disk_dtype = np.uint16 if np.dtype(dtype).itemsize == 2 else np.dtype(dtype)
    manifest = matching_manifest(
        store / STORE_MANIFEST, key, "target features of another pass",
        "delete it or point the feature cache at another directory.",
    )
    if manifest is not None:
        done = int(manifest["sequences_done"])
        mode = "r" if manifest.get("complete") else "r+"
        arrays = {name: np.load(store / f"{name}.npy", mmap_mode=mode) for name in shapes}
    else:
        store.mkdir(parents=True, exist_ok=True)
        arrays = {
            name: np.lib.format.open_memmap(store / f"{name}.npy", mode="w+", dtype=disk_dtype, shape=shape)
            for name, shape in shapes.items()
        }
        done = 0
        write_json_atomic(store / STORE_MANIFEST, {**key, "sequences_done": 0, "complete": False})
    return {name: a.view(dtype) for name, a in arrays.items()}, done


def compute_features(
    params: Any,
    cfg: ModelConfig,
    data: TokenDataset,
    capture_layers: Sequence[int],
    seq_len: int,
    batch_size: int = 8,
    progress: bool = True,
    dtype: Any = np.float32,
    store: str | os.PathLike | None = None,
) -> TargetFeatures:
    """dtype: how they are stored (np.float32 or ml_dtypes.bfloat16); batches get float32.
    store: a directory to keep them in on disk (resumed and reused; see the module docstring)."""
    from tqdm.auto import tqdm

    capture = tuple(capture_layers)
    n_cap = len(capture_layers) * cfg.hidden_size
    kept = np.minimum(np.diff(data.offsets), seq_len)
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    shapes = {"captured": (int(offsets[-1]), n_cap), "final": (int(offsets[-1]), cfg.hidden_size)}
    if store is None:
        arrays, done = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}, 0
    else:
        store = Path(store)
        key = store_key(params, data, capture, seq_len, dtype)
        arrays, done = _open_store(store, key, shapes, dtype)
        if progress and done:
            state = "reusing" if done == len(data) else f"resuming at sequence {done} of {len(data)} in"
            print(f"target features: {state} {store}", file=sys.stderr)
    captured, final = arrays["captured"], arrays["final"]
    if done < len(data):
        run = jitted_target_features(cfg, capture)
        starts = range(done, len(data), batch_size)
        flush_every = max(1, STORE_FLUSH_EVERY // batch_size)
        for n, start in enumerate(tqdm(starts, desc="target features", unit="batch", disable=not progress)):
            rows = range(start, min(start + batch_size, len(data)))
            tokens = np.zeros((batch_size, seq_len), np.int32)
            for r, i in enumerate(rows):
                seq = data.sequence(i)[:seq_len]
                tokens[r, : len(seq)] = seq
            cap, fin = jax.device_get(run(params, jnp.asarray(tokens)))
            for r, i in enumerate(rows):
                lo, hi = offsets[i], offsets[i + 1]
                captured[lo:hi] = cap[r, : hi - lo]
                final[lo:hi] = fin[r, : hi - lo]
            finished = rows.stop == len(data)
            if store is not None and (finished or (n + 1) % flush_every == 0):
                for a in (captured, final):
                    a.flush()  # the rows on disk before the manifest says they are done
                progress_now = {"sequences_done": rows.stop, "complete": finished}
                write_json_atomic(store / STORE_MANIFEST, {**key, **progress_now})
        if store is not None:
            arrays, _ = _open_store(store, key, shapes, dtype)  # read-only from here on
            captured, final = arrays["captured"], arrays["final"]
    return TargetFeatures(capture, captured, final, offsets)


def gather_features(
    data: TokenDataset, features: TargetFeatures, picks: Sequence[int], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch feature arrays [B, seq_len, n*H] and [B, seq_len, H] for sequences `picks`."""
    cap = np.zeros((len(picks), seq_len, features.captured.shape[1]), np.float32)
    fin = np.zeros((len(picks), seq_len, features.final.shape[1]), np.float32)
    for r, i in enumerate(picks):
        lo, hi = features.offsets[i], features.offsets[i + 1]
        n = min(hi - lo, seq_len)
        cap[r, :n] = features.captured[lo : lo + n]
        fin[r, :n] = features.final[lo : lo + n]
    return cap, fin
