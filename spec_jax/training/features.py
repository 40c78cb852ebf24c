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
`pooled_features` keeps one such store per data part (each dataset file or shard) in a pool
directory, so a run that adds data to an earlier mix computes the new parts only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.interface import TargetModel
from spec_jax.models.resolve import as_target_model
from spec_jax.training.data import TokenDataset
from spec_jax.training.provenance import (
    arrays_sha256,
    matching_manifest,
    read_json,
    weights_sha256,
    write_json_atomic,
    writer_lock,
)


@dataclasses.dataclass
class TargetFeatures:
    """captured [rows, n*H] and final [rows, H]: sequence i's first min(len, seq_len) tokens are
    rows offsets[i] .. offsets[i + 1]."""

    capture_layers: tuple[int, ...]
    captured: np.ndarray
    final: np.ndarray
    offsets: np.ndarray


def target_features(
    params: Any, model: TargetModel | ModelConfig, tokens: jax.Array, capture_layers: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """(captured [B, T, n*H], final [B, T, H]) of the target model (or built-in config) over
    `tokens` [B, T]."""
    model = as_target_model(model)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    final, captured, _ = model.forward(
        params, tokens, positions, model.init_cache(b, t), capture=tuple(capture_layers)
    )
    if captured is None:
        captured = jnp.zeros((b, t, 0), final.dtype)
    return jax.lax.stop_gradient(captured), jax.lax.stop_gradient(final)


@functools.lru_cache(maxsize=8)
def jitted_target_features(cfg: TargetModel | ModelConfig, capture_layers: tuple[int, ...]):
    """`target_features` compiled for (params, tokens), once per config (every part of a pool reuses it)."""
    return jax.jit(lambda params, tokens: target_features(params, cfg, tokens, capture_layers))


@dataclasses.dataclass(frozen=True)
class WithTargetFeatures:
    """A loss whose batch gets `captured` and `final` from the frozen target inside the step."""

    loss: Any
    target_model: TargetModel | ModelConfig
    capture_layers: tuple[int, ...]

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        captured, final = target_features(target_params, self.target_model, batch["tokens"], self.capture_layers)
        return self.loss(params, target_params, {**batch, "captured": captured, "final": final}, key)


def precompute_fits(
    num_tokens: int, capture_layers: Sequence[int], hidden: int, limit_gb: float = 4.0, bytes_per_value: int = 4
) -> bool:
    """Whether precomputed features of a dataset stay under `limit_gb` of host memory."""
    return num_tokens * (len(capture_layers) + 1) * hidden * bytes_per_value <= limit_gb * 2**30


STORE_MANIFEST = "features.json"
# Sequences between two saves of an on-disk pass: what an interruption can cost.
STORE_FLUSH_EVERY = 256


def store_key(params: Any, data: TokenDataset, capture_layers: Sequence[int], seq_len: int, dtype: Any,
              target_sha256: str | None = None) -> dict:
    """What a stored feature pass depends on: the target's weights, the token data, the layers,
    seq_len and the storage dtype (hashes, so a changed target or dataset never reuses features).
    target_sha256: `weights_sha256(params)` when already known."""
    return {
        "target_sha256": target_sha256 or weights_sha256(params),
        "data_sha256": data.content_sha256(),
        "capture_layers": [int(i) for i in capture_layers],
        "seq_len": int(seq_len),
        "dtype": np.dtype(dtype).name,
    }


def _damaged(store: Path, what: str) -> ValueError:
    return ValueError(
        f"The target-feature cache {store} is damaged ({what}); delete that directory and re-run "
        "(its features are recomputed)."
    )


def _load_array(store: Path, name: str, mode: str, shape: tuple[int, int]) -> np.ndarray:
    path = store / f"{name}.npy"
    try:
        array = np.load(path, mmap_mode=mode)
    except (OSError, ValueError, EOFError) as e:
        raise _damaged(store, f"{path.name}: {type(e).__name__}: {e}") from e
    if array.shape != tuple(shape):
        raise _damaged(store, f"{path.name} holds {array.shape}, the manifest's pass needs {tuple(shape)}")
    return array


def _chunk_hashes(arrays: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, str]:
    return {f"{name}_sha256": arrays_sha256(a[lo:hi]) for name, a in sorted(arrays.items())}


def _verify_chunks(store: Path, manifest: dict, arrays: dict[str, np.ndarray], rows_done: int) -> list[dict]:
    """Check the stored rows against the checksums recorded as they were written; a store from
    before checksums gets them now (its rows are trusted once). Returns the chunk records."""
    chunks = manifest.get("chunks")
    if chunks is None:
        return [{"rows": rows_done, **_chunk_hashes(arrays, 0, rows_done)}] if rows_done else []
    lo = 0
    for chunk in chunks:
        found = _chunk_hashes(arrays, lo, chunk["rows"])
        bad = [k.removesuffix("_sha256") + ".npy" for k, v in found.items() if chunk.get(k) != v]
        if bad:
            raise _damaged(store, f"rows {lo}..{chunk['rows']} of {', '.join(bad)} differ from their recorded sha256")
        lo = chunk["rows"]
    if lo != rows_done:
        raise _damaged(store, f"checksums cover {lo} rows, the manifest says {rows_done} are done")
    return chunks


def _open_store(store: Path, key: dict, shapes: dict[str, tuple[int, int]], dtype: Any,
                row_offsets: np.ndarray, verify: bool = True):
    """(memmaps by name, viewed as dtype; sequences already done; checksum records). A new store
    is created; one holding another pass's features is refused rather than overwritten, and the
    rows of an existing one are checked against their recorded checksums (`verify`)."""
    # .npy has no bfloat16: it is stored as its uint16 bits and viewed back.
    disk_dtype = np.uint16 if np.dtype(dtype).itemsize == 2 else np.dtype(dtype)
    manifest = matching_manifest(
        store / STORE_MANIFEST, key, "target features of another pass",
        "delete it or point the feature cache at another directory.",
    )
    if manifest is not None:
        done = int(manifest["sequences_done"])
        mode = "r" if manifest.get("complete") else "r+"
        arrays = {name: _load_array(store, name, mode, shape) for name, shape in shapes.items()}
        chunks = manifest.get("chunks", [])
        if verify:
            chunks = _verify_chunks(store, manifest, arrays, int(row_offsets[done]))
            if "chunks" not in manifest:
                write_json_atomic(store / STORE_MANIFEST, {**manifest, "chunks": chunks})
    else:
        store.mkdir(parents=True, exist_ok=True)
        arrays = {
            name: np.lib.format.open_memmap(store / f"{name}.npy", mode="w+", dtype=disk_dtype, shape=shape)
            for name, shape in shapes.items()
        }
        done, chunks = 0, []
        write_json_atomic(store / STORE_MANIFEST, {**key, "sequences_done": 0, "complete": False, "chunks": []})
    return {name: a.view(dtype) for name, a in arrays.items()}, done, chunks


def _complete(store: Path) -> bool:
    manifest = store / STORE_MANIFEST
    return manifest.is_file() and bool(_read_store_manifest(manifest).get("complete"))


def _read_store_manifest(path: Path) -> dict:
    manifest = read_json(path, f"delete {path.parent} and re-run (its features are recomputed).")
    if not isinstance(manifest, dict):
        raise _damaged(path.parent, f"{path.name} is not a manifest")
    return manifest


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
    target_sha256: str | None = None,
) -> TargetFeatures:
    """dtype: how they are stored (np.float32 or ml_dtypes.bfloat16); batches get float32.
    store: a directory to keep them in on disk (resumed and reused; see the module docstring)."""
    from tqdm.auto import tqdm

    capture = tuple(capture_layers)
    n_cap = len(capture_layers) * cfg.hidden_size
    kept = np.minimum(np.diff(data.offsets), seq_len)
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    shapes = {"captured": (int(offsets[-1]), n_cap), "final": (int(offsets[-1]), cfg.hidden_size)}
    with contextlib.ExitStack() as writing:  # a store being written holds its writer lock
        if store is None:
            arrays, done = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}, 0
        else:
            store = Path(store)
            key = store_key(params, data, capture, seq_len, dtype, target_sha256)
            if not _complete(store):
                store.mkdir(parents=True, exist_ok=True)
                writing.enter_context(writer_lock(store, "target-feature pass"))
            arrays, done, chunks = _open_store(store, key, shapes, dtype, offsets)
            if progress and 0 < done < len(data):
                print(f"target features: resuming at sequence {done} of {len(data)} in {store}", file=sys.stderr)
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
                    lo, hi = (chunks[-1]["rows"] if chunks else 0), int(offsets[rows.stop])
                    chunks.append({"rows": hi, **_chunk_hashes({"captured": captured, "final": final}, lo, hi)})
                    progress_now = {"sequences_done": rows.stop, "complete": finished, "chunks": chunks}
                    write_json_atomic(store / STORE_MANIFEST, {**key, **progress_now})
            if store is not None:  # read-only from here on (just written: no need to check again)
                arrays, _, _ = _open_store(store, key, shapes, dtype, offsets, verify=False)
                captured, final = arrays["captured"], arrays["final"]
    return TargetFeatures(capture, captured, final, offsets)


class StackedRows:
    """Row-wise concatenation of 2-D arrays (memory-mapped stores), read by row ranges that lie
    inside one of them, without copying them into one array."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = list(arrays)
        self.ends = np.cumsum([a.shape[0] for a in self.arrays])
        self.shape = (int(self.ends[-1]), self.arrays[0].shape[1])

    def __getitem__(self, rows: slice) -> np.ndarray:
        k = int(np.searchsorted(self.ends, rows.start, side="right"))
        base = int(self.ends[k - 1]) if k else 0
        if rows.stop > self.ends[k]:
            raise IndexError(f"rows {rows.start}:{rows.stop} span two stacked arrays")
        return self.arrays[k][rows.start - base : rows.stop - base]


def part_store(pool: str | os.PathLike, key: dict) -> Path:
    """The store of one data part's features in a pool: named by its `store_key`."""
    return Path(pool) / f"part-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}"


def _pooled_store(pool: str | os.PathLike, key: dict) -> tuple[Path, tuple[int, ...]]:
    """(store, its capture layers) for one part: its own store, or else a finished one of the same
    target, tokens, seq_len and dtype that captured more layers (a DFlash pass serves a draft
    model's KL, which needs the final states only)."""
    own = part_store(pool, key)
    if own.is_dir() or not Path(pool).is_dir():
        return own, tuple(key["capture_layers"])
    wanted = set(key["capture_layers"])
    for manifest in sorted(Path(pool).glob(f"part-*/{STORE_MANIFEST}")):
        other = _read_store_manifest(manifest)
        same = all(other.get(k) == v for k, v in key.items() if k != "capture_layers")
        if same and other.get("complete") and wanted <= set(other["capture_layers"]):
            return manifest.parent, tuple(other["capture_layers"])
    return own, tuple(key["capture_layers"])


class ColumnsOf:
    """Some columns of a 2-D array (a memory-mapped store), read by row ranges."""

    def __init__(self, array: Any, columns: np.ndarray):
        self.array, self.columns = array, columns
        self.shape = (array.shape[0], len(columns))

    def __getitem__(self, rows: slice) -> np.ndarray:
        return np.asarray(self.array[rows])[:, self.columns]


def pooled_features(
    params: Any,
    cfg: ModelConfig,
    data: TokenDataset,
    capture_layers: Sequence[int],
    seq_len: int,
    pool: str | os.PathLike,
    dtype: Any = np.float32,
    progress: bool = True,
) -> TargetFeatures:
    """Features of `data` with each of its parts (`data.parts`: its files and shards) in its own
    store under `pool`, named by a hash of what the part's features depend on. A run whose data
    shares parts with an earlier one (more shards, another file added to the mix) computes only
    the new parts; two runs can share one pool, and a run that needs fewer layers reads the
    stores of one that captured more. A pool directory that is itself one store of the whole
    dataset (as runs wrote before pools) is resumed or reused when it matches."""
    capture = tuple(capture_layers)
    target_sha = weights_sha256(params)
    whole = Path(pool) / STORE_MANIFEST
    if whole.is_file():
        key = store_key(params, data, capture, seq_len, dtype, target_sha)
        if all(v == _read_store_manifest(whole).get(k) for k, v in key.items()):
            return compute_features(params, cfg, data, capture, seq_len, progress=progress, dtype=dtype,
                                    store=pool, target_sha256=target_sha)
    parts = data.part_datasets()
    found = [_pooled_store(pool, store_key(params, part, capture, seq_len, dtype, target_sha)) for part in parts]
    if progress:
        complete = sum(_complete(store) for store, _ in found)
        print(f"target features: {complete} of {len(parts)} data parts already in {pool}", file=sys.stderr)
    pieces = []
    for part, (store, layers) in zip(parts, found):
        piece = compute_features(params, cfg, part, layers, seq_len, progress=progress, dtype=dtype,
                                 store=store, target_sha256=target_sha)
        if layers != capture:  # a store of more layers: read the requested ones' columns
            h = cfg.hidden_size
            cols = np.asarray([layers.index(i) * h + c for i in capture for c in range(h)], np.int64)
            piece = TargetFeatures(capture, ColumnsOf(piece.captured, cols), piece.final, piece.offsets)
        pieces.append(piece)
    if len(pieces) == 1:
        return pieces[0]
    rows = [p.offsets[-1] for p in pieces]
    offsets = np.concatenate([[0]] + [p.offsets[1:] + base for p, base in zip(pieces, np.cumsum([0] + rows[:-1]))])
    return TargetFeatures(capture, StackedRows([p.captured for p in pieces]),
                          StackedRows([p.final for p in pieces]), offsets.astype(np.int64))


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
