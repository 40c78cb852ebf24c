"""HF checkpoints (config.json + safetensors) to and from spec_jax's params.

One table per family (`spec_jax.checkpoints.hf_names`) says how each HF decoder-layer weight maps
to our per-layer layout. `layers_from_hf` / `layers_to_hf` apply a table under any per-layer name
prefix, so the target loader (`model.layers.{i}.`) and the DFlash drafter loader (`layers.{i}.`)
share them.

HF stores a linear layer as [out, in]; we store [in..., out...] with heads split out, e.g.
q_proj [N*D, H] -> wq [H, N, D] and o_proj [H, N*D] -> wo [N, D, H]. Both directions are a
transpose plus a reshape, fixed by how many leading axes of our layout are the input side.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

import numpy as np

from spec_jax.checkpoints.atomic import atomic_path
from spec_jax.checkpoints.errors import CheckpointError, CheckpointNotFoundError
from spec_jax.checkpoints.mxfp4 import dequantize_mxfp4, mxfp4_float_shape, mxfp4_names
from spec_jax.checkpoints.quantized import dequantize, float_shape, quantized_names
from spec_jax.models.config import ModelConfig
from spec_jax.models.weights import (
    WeightSpec,
    check_params_match_specs,
    model_weight_specs,
)

Params = dict[str, Any]
LayerPrefix = str | Callable[[int], str]
GetTensor = Callable[[str], np.ndarray]

TARGET_LAYER_PREFIX = "model.layers.{i}."


# The tables live in hf_names.py; these names stay importable from here.
from spec_jax.checkpoints.hf_names import (  # noqa: E402,F401
    DECODER_LAYER as LAYER_WEIGHTS,
    EXPERTS_T,
    FLAT,
    FUSED_EXPERTS_MARK,
    MODEL_TABLE as _MODEL_WEIGHT,
    MODEL_WEIGHTS,
    HFWeight,
    expert_parts,
    layer_table,
    multimodal_text_name,
)

LayerTable = Mapping[str, HFWeight]
_LAYER_WEIGHT = layer_table()

# Buffers that some checkpoints carry but that hold no parameters.
# Rotary buffers; the MTP head Qwen3.5 / Qwen3-Next checkpoints carry (`mtp.*`, which
# transformers skips too).
_IGNORED_HF_NAMES = re.compile(r".*\.rotary_emb\.inv_freq$|^mtp\.")


# ----------------------------------------------------------------------------- layout mapping
def hf_shape(shape: tuple[int, ...], in_axes: int) -> tuple[int, ...]:
    """HF shape of one (unstacked) weight whose shape in our layout is `shape`."""
    if in_axes == 0:
        return tuple(shape)
    if in_axes == FLAT:
        return (math.prod(shape),)
    if in_axes == EXPERTS_T:
        return (shape[0], shape[2], shape[1])
    return (math.prod(shape[in_axes:]), math.prod(shape[:in_axes]))


def from_hf(w: np.ndarray, shape: tuple[int, ...], in_axes: int) -> np.ndarray:
    """One HF tensor -> our layout `shape`."""
    if in_axes == EXPERTS_T:
        return np.swapaxes(w, 1, 2).reshape(shape)
    return w.reshape(shape) if in_axes in (0, FLAT) else w.T.reshape(shape)


def to_hf(w: np.ndarray, in_axes: int) -> np.ndarray:
    """One (unstacked) weight in our layout -> HF layout."""
    if in_axes == 0:
        return w
    if in_axes == FLAT:
        return w.reshape(-1)
    if in_axes == EXPERTS_T:
        return np.swapaxes(w, 1, 2)
    return w.reshape(math.prod(w.shape[:in_axes]), -1).T


def paired_axis(w: HFWeight) -> int | None:
    """The axis of an HF tensor holding two of our arrays (`w.interleaved`: -1, `w.half`: -2);
    None for a weight with an HF tensor of its own."""
    return -1 if w.interleaved is not None else -2 if w.half is not None else None


def paired_index(w: HFWeight, size: int) -> tuple[Any, ...]:
    """Where ours sits in its shared HF tensor, `size` the length of ours on `paired_axis`."""
    if w.interleaved is not None:
        return (..., slice(w.interleaved, None, 2))
    return (..., slice(w.half * size, (w.half + 1) * size), slice(None))


def paired_shape(w: HFWeight, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shared HF tensor's shape from one of its two arrays' HF shape `shape`."""
    axis = len(shape) + paired_axis(w)
    return (*shape[:axis], 2 * shape[axis], *shape[axis + 1:])


def _prefix_fn(prefix: LayerPrefix) -> Callable[[int], str]:
    return prefix if callable(prefix) else (lambda i: prefix.format(i=i))


def _layer_weight(name: str, table: LayerTable | None = None) -> HFWeight:
    table = _LAYER_WEIGHT if table is None else table
    if name not in table:
        raise ValueError(f"no HF name is known for layer weight {name!r}; add it to hf_names.py")
    return table[name]


def expected_hf_layer_shapes(
    layer_specs: Sequence[Mapping[str, WeightSpec]], prefix: LayerPrefix, table: LayerTable | None = None
) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape for every per-layer tensor of `layer_specs` (one dict per layer);
    `table`: the family's names (`hf_names.layer_table`; default the plain decoder's)."""
    name_of = _prefix_fn(prefix)
    out = {}
    for i, specs in enumerate(layer_specs):
        for name, spec in specs.items():
            w = _layer_weight(name, table)
            for hf_name, expert in expert_parts(w, spec.shape):
                shape = hf_shape(spec.shape[expert is not None:], w.in_axes)
                if paired_axis(w) is not None:  # one of two arrays in the HF tensor
                    shape = paired_shape(w, shape)
                out[name_of(i) + hf_name] = shape
    return out


def layers_from_hf(
    get_tensor: GetTensor,
    prefix: LayerPrefix,
    layer_specs: Sequence[Mapping[str, WeightSpec]],
    table: LayerTable | None = None,
) -> list[dict[str, np.ndarray]]:
    """Read per-layer HF tensors into our layout: one dict per layer, as `layer_specs` describes.

    get_tensor: HF name -> array (already in the wanted dtype).
    prefix:     "model.layers.{i}." (targets), "layers.{i}." (DFlash), or a function of the layer
                index for checkpoints that name some layers differently.
    table:      the family's HF names (`hf_names.layer_table`); default the plain decoder's.
    """
    name_of = _prefix_fn(prefix)
    return [
        {
            name: _read_layer_weight(get_tensor, name_of(i), _layer_weight(name, table), spec.shape)
            for name, spec in specs.items()
        }
        for i, specs in enumerate(layer_specs)
    ]


def _read_layer_weight(get_tensor: GetTensor, prefix: str, w: HFWeight, shape: tuple[int, ...]) -> np.ndarray:
    """One weight in our layout `shape` from its HF tensor, or a per-expert weight's E tensors stacked."""
    def read(hf_name: str) -> np.ndarray:
        tensor = get_tensor(prefix + hf_name)
        axis = paired_axis(w)
        return tensor if axis is None else tensor[paired_index(w, tensor.shape[axis] // 2)]

    parts = [from_hf(read(hf_name), shape[expert is not None:], w.in_axes)
             for hf_name, expert in expert_parts(w, shape)]
    return np.stack(parts) if "{e}" in w.hf_name else parts[0]


def layers_to_hf(
    layers: Sequence[Mapping[str, Any]], prefix: LayerPrefix, table: LayerTable | None = None
) -> dict[str, np.ndarray]:
    """Inverse of `layers_from_hf`: per-layer params -> {HF name: tensor}."""
    name_of = _prefix_fn(prefix)
    out = {}
    for i, layer in enumerate(layers):
        for name, value in layer.items():
            w = _layer_weight(name, table)
            for hf_name, expert in expert_parts(w, np.shape(value)):
                part = to_hf(np.asarray(value if expert is None else value[expert]), w.in_axes)
                axis = paired_axis(w)
                if axis is not None:  # fill its half of the tensor it shares
                    shared = out.setdefault(name_of(i) + hf_name, np.empty(paired_shape(w, part.shape), part.dtype))
                    shared[paired_index(w, part.shape[axis])] = part
                    continue
                out[name_of(i) + hf_name] = np.ascontiguousarray(part)
    return out


def expected_hf_shapes(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor a target checkpoint with config `cfg` must hold
    (`fused_experts`: a MoE model's experts as fused 3-D tensors, `hf_names.layer_table`)."""
    specs = model_weight_specs(cfg)
    table = layer_table(cfg.architecture, fused_experts)
    out = expected_hf_layer_shapes(specs["layers"], TARGET_LAYER_PREFIX, table)
    for name, spec in specs.items():
        if name != "layers":
            w = _MODEL_WEIGHT[name]
            out[w.hf_name] = hf_shape(spec.shape, w.in_axes)
    return out


def unused_shared_kv_names(cfg: ModelConfig) -> list[str]:
    """Gemma 4 checkpoints may hold k/v projections and norms for the KV-shared layers that no
    computation reads (transformers skips them on load too)."""
    return [
        TARGET_LAYER_PREFIX.format(i=i) + f"self_attn.{name}.weight"
        for i in range(cfg.num_layers) if cfg.kv_source(i) != i
        for name in ("k_proj", "v_proj", "k_norm", "v_norm")
    ]


def params_from_hf(get_tensor: GetTensor, cfg: ModelConfig, fused_experts: bool = False) -> Params:
    """Target params (host numpy) from HF-named tensors (`fused_experts`: see `expected_hf_shapes`)."""
    specs = model_weight_specs(cfg)
    table = layer_table(cfg.architecture, fused_experts)
    params: Params = {"layers": layers_from_hf(get_tensor, TARGET_LAYER_PREFIX, specs["layers"], table)}
    for name, spec in specs.items():
        if name != "layers":
            w = _MODEL_WEIGHT[name]
            params[name] = from_hf(get_tensor(w.hf_name), spec.shape, w.in_axes)
    check_params_match_specs(params, specs)
    return params


def params_to_hf(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Target params -> {HF name: numpy tensor} (no lm_head when embeddings are tied)."""
    check_params_match_specs(params, model_weight_specs(cfg), what="params")
    out = layers_to_hf(params["layers"], TARGET_LAYER_PREFIX, layer_table(cfg.architecture))
    for name, value in params.items():
        if name != "layers":
            w = _MODEL_WEIGHT[name]
            out[w.hf_name] = np.ascontiguousarray(to_hf(np.asarray(value), w.in_axes))
    return out


def check_hf_tensors(
    available: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
    ignore: Iterable[str] = (),
) -> None:
    """Raise one CheckpointError naming every missing, unknown or mis-shaped tensor."""
    ignore = set(ignore)
    present = {n for n in available if n not in ignore and not _IGNORED_HF_NAMES.match(n)}
    missing = sorted(set(expected) - present)
    unknown = sorted(present - set(expected))
    wrong = [
        f"{n}: config implies {tuple(expected[n])}, file has {tuple(available[n])}"
        for n in sorted(present & set(expected))
        if tuple(available[n]) != tuple(expected[n])
    ]
    problems = []
    if wrong:
        problems.append(
            "shape mismatch between config.json and the weights (" + "; ".join(_clip(wrong)) + ")"
        )
    if missing:
        problems.append(f"missing weights {_clip(missing)}")
    if unknown:
        problems.append(f"unknown weights {_clip(unknown)}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {source} does not match its config: "
            + "; ".join(problems)
            + ". Check that config.json belongs to these weights and that the model is a plain "
            "Llama, Mistral, Qwen2/3, Gemma 3 or Gemma 4 decoder."
        )


def _clip(items: list[str], limit: int = 8) -> list[str]:
    return items if len(items) <= limit else items[:limit] + [f"... {len(items) - limit} more"]


# ----------------------------------------------------------------------------- files
def looks_like_hub_id(spec: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec)) and not spec.endswith(".gguf")


def resolve_hf_dir(spec: str | os.PathLike) -> Path:
    """A local checkpoint dir for `spec`: an existing directory, or a hub id downloaded by
    `huggingface_hub.snapshot_download` (config, safetensors and tokenizer files only)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(
            f"{str(spec)!r} is a file, not a checkpoint directory; pass the directory holding "
            "config.json and *.safetensors (or a .gguf file)."
        )
    if not looks_like_hub_id(str(spec)):
        raise CheckpointNotFoundError(
            f"Checkpoint path {str(spec)!r} does not exist; pass an existing HF checkpoint dir, a .gguf "
            "file, or a hub id like 'org/name'."
        )
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id=str(spec),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"],
        )
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise CheckpointNotFoundError(
            f"Could not fetch hub model {str(spec)!r} ({type(e).__name__}: {e}). Download it on a "
            f"machine with network access (`huggingface-cli download {spec}`) or pass a local "
            "checkpoint directory instead."
        ) from e
    return Path(local)


class SafetensorsFiles(contextlib.AbstractContextManager):
    """The tensors of a checkpoint dir (one file or a sharded index), opened lazily as numpy."""

    def __init__(self, directory: Path):
        from safetensors import SafetensorError, safe_open

        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(
                    f"{index} is not a valid safetensors index ({e}); re-download the checkpoint."
                ) from e
            files = sorted(set(weight_map.values()))
        elif (directory / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"No *.safetensors weights in {directory}; spec_jax reads safetensors only. Re-save the "
                "model with `model.save_pretrained(dir, safe_serialization=True)`."
            )
        self._stack = contextlib.ExitStack()
        self._handles = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._file_of: dict[str, str] = {}
        dtypes: dict[str, str] = {}
        for name in files:
            file = directory / name
            if not file.exists():
                raise CheckpointError(
                    f"Shard {name} listed in {index.name} is missing from {directory}; re-download "
                    "the checkpoint."
                )
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="numpy"))
            except (SafetensorError, OSError) as e:
                self._stack.close()
                raise CheckpointError(
                    f"Weights file {file} is truncated or corrupt ({e}); re-download or re-save it."
                ) from e
            self._handles[name] = handle
            for key in handle.keys():
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
                self._file_of[key] = name
                dtypes[key] = handle.get_slice(key).get_dtype()
        # Quantized weights and their scales (checkpoints/quantized.py) read as float ones.
        self._scale_of = quantized_names(dtypes)
        for name, scale in self._scale_of.items():
            del self.shapes[scale]
            self.shapes[name] = float_shape(self.shapes[name], dtypes[name])
        # So do MXFP4 blocks + scales (gpt-oss's experts, checkpoints/mxfp4.py), under the weight's name.
        self._mxfp4 = mxfp4_names(dtypes)
        for name, (blocks, scales) in self._mxfp4.items():
            self.shapes[name] = mxfp4_float_shape(self.shapes.pop(blocks))
            del self.shapes[scales]
            self._file_of[name] = self._file_of[blocks]

    def canonical_names(self, canonical: Callable[[str], str], source: str) -> dict[str, str]:
        """{canonical name: name in the file} for checkpoints that spell weights several ways;
        two spellings of one weight are a CheckpointError."""
        original_of: dict[str, str] = {}
        for name in self.shapes:
            key = canonical(name)
            if key in original_of:
                raise CheckpointError(
                    f"{source} holds both {original_of[key]!r} and {name!r}, two spellings of the "
                    f"weight {key!r}; keep one."
                )
            original_of[key] = name
        return original_of

    def get_tensor(self, name: str, dtype: Any = None) -> np.ndarray:
        from safetensors import SafetensorError

        try:
            if name in self._mxfp4:
                return self._read_mxfp4(name, dtype)
            array = self._handles[self._file_of[name]].get_tensor(name)
            if name in self._scale_of:
                scale = self._scale_of[name]
                array = dequantize(array, self._handles[self._file_of[scale]].get_tensor(scale))
        except SafetensorError as e:
            raise CheckpointError(
                f"Could not read {name} from {self.directory / self._file_of[name]} ({e}); the file "
                "is corrupt, re-download or re-save it."
            ) from e
        return array if dtype is None else np.asarray(array, dtype=dtype)

    def _read_mxfp4(self, name: str, dtype: Any) -> np.ndarray:
        blocks, scales = (self._handles[self._file_of[n]].get_tensor(n) for n in self._mxfp4[name])
        return dequantize_mxfp4(blocks, scales).astype(dtype or np.float32, copy=False)

    def __exit__(self, *exc):
        self._stack.close()
        return None


def read_config_json(directory: Path, needs: str, remedy: str = "fix or re-download it") -> Any:
    """`directory`/config.json, parsed. A missing file is a CheckpointError that says what a
    checkpoint dir `needs`; one that is not JSON, one that names the file and the `remedy`."""
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{directory} has no config.json; {needs}")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); {remedy}.") from e


def read_hf_config(directory: Path, dtype: str = "float32") -> tuple[dict[str, Any], ModelConfig]:
    config_file = directory / "config.json"
    hf = read_config_json(directory, "an HF checkpoint dir needs config.json next to its *.safetensors files.")
    check_config_fields(hf, config_file)
    try:
        cfg = ModelConfig.from_hf_config(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{config_file} lacks the field {e}; it is not a complete decoder config.") from e
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: {type(e).__name__}: {e}; fix or re-download it.") from e
    return hf, cfg


# Fields of a decoder config.json and what their values must be (when present).
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def check_config_fields(hf: Any, config_file: Path) -> None:
    """A config.json must be a JSON object whose size fields are positive integers and whose
    float fields are numbers; anything else is a CheckpointError naming the field."""
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{config_file} holds a JSON {type(hf).__name__}, not an object of model settings; fix or "
            "re-download it."
        )
    for name in _INT_FIELDS:
        value = hf.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{config_file}: {name} must be a positive integer, got {value!r}.")
    for name in _FLOAT_FIELDS:
        value = hf.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{config_file}: {name} must be a number, got {value!r}.")
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise CheckpointError(f"{config_file}: {name} must be an object, got {hf[name]!r}.")


def load_hf_dir(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """(config, host numpy params) from an HF checkpoint dir or hub id.

    Every name and shape is checked against config.json before any tensor is read.
    """
    import jax.numpy as jnp

    directory = resolve_hf_dir(path)
    hf, cfg = read_hf_config(directory, dtype)
    np_dtype = jnp.dtype(dtype)
    with SafetensorsFiles(directory) as files:
        shapes, file_name = files.shapes, (lambda n: n)
        if "text_config" in hf:  # Gemma3/4ForConditionalGeneration: its text decoder only
            file_name = {multimodal_text_name(n): n for n in files.shapes}
            file_name.pop(None, None)
            shapes = {n: files.shapes[f] for n, f in file_name.items()}
            file_name = file_name.__getitem__
        ignore = ["lm_head.weight"] if cfg.tie_embeddings else []  # a tied head duplicates the embedding
        ignore += unused_shared_kv_names(cfg)
        fused = any(n.endswith(FUSED_EXPERTS_MARK) for n in shapes)  # transformers 5's in-memory experts
        check_hf_tensors(shapes, expected_hf_shapes(cfg, fused), str(directory), ignore=ignore)
        params = params_from_hf(lambda n: files.get_tensor(file_name(n), np_dtype), cfg, fused)
    return cfg, params


def save_hf_dir(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: Params,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) that transformers loads.

    Written to a temporary sibling dir and renamed into place, so `path` never holds half a
    checkpoint. An existing non-empty `path` is replaced only with overwrite=True.
    """
    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    tensors = params_to_hf(cfg, params)  # checks params against cfg before writing anything
    return write_checkpoint_dir(path, cfg.to_hf_config(), tensors, tokenizer)


def check_vocab_map(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int, source: str) -> None:
    """A reduced draft vocabulary's map (speculators: target id = draft id + d2t[draft id]; t2d
    marks those target ids) must be one-to-one into the target vocabulary, t2d agreeing."""
    target_ids = np.arange(len(d2t)) + d2t
    problems = []
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        problems.append(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    elif len(np.unique(target_ids)) != len(target_ids):
        problems.append("d2t maps two draft ids to one target id")
    elif t2d is not None and (t2d.sum() != len(d2t) or not t2d[target_ids].all()):
        problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        raise CheckpointError(f"{source}: inconsistent vocabulary map ({'; '.join(problems)}); re-export it.")


def read_vocab_map(
    get_tensor: Callable[[str, Any], np.ndarray], names: Container[str], draft_vocab_size: int, vocab_size: int,
    source: str,
) -> np.ndarray:
    """A speculators drafter's vocabulary map from its `d2t` / `t2d` tensors (`get_tensor(name,
    None)`; `names`: those it has), checked (`check_vocab_map`): the d2t offsets as int32. No d2t
    is the identity map (zero offsets); no t2d leaves d2t to check alone."""
    d2t = get_tensor("d2t", None).astype(np.int64) if "d2t" in names else np.zeros(draft_vocab_size, np.int64)
    t2d = get_tensor("t2d", None).astype(bool) if "t2d" in names else None
    check_vocab_map(d2t, t2d, vocab_size, source)
    return d2t.astype(np.int32)


def vocab_map_tensors(d2t: Any, vocab_size: int) -> dict[str, np.ndarray]:
    """The `d2t` (int64 offsets) and `t2d` (bool mask) tensors speculators checkpoints carry."""
    d2t = np.asarray(d2t).astype(np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    return {"d2t": d2t, "t2d": t2d}


def refuse_to_clobber(path: Path, overwrite: bool) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise CheckpointError(f"{path} already exists and is not empty; pass overwrite=True or a new path.")


def save_dir(path: str | os.PathLike, params: Any, specs: Any, what: str, overwrite: bool) -> Path:
    """Where a drafter's save goes: `params` checked against its weight `specs`, and an existing
    non-empty `path` refused unless `overwrite`, before anything is written."""
    check_params_match_specs(params, specs, what=what)
    path = Path(path).expanduser().absolute()
    refuse_to_clobber(path, overwrite)
    return path


def read_named_tensors(
    directory: Path,
    names: Sequence[tuple[str, tuple[int, ...], int]],
    source: str,
    dtype: str,
    ignore: Iterable[str] = (),
    dtypes: Mapping[str, Any] | None = None,
) -> list[np.ndarray]:
    """The tensors `names` lists ((HF name, shape in our layout, in_axes) each) of a checkpoint
    dir, in our layout and in that order; every name and shape is checked (`check_hf_tensors`)
    before any tensor is read. `dtypes` gives some names a dtype other than `dtype`."""
    dtypes = dtypes or {}
    with SafetensorsFiles(directory) as files:
        check_hf_tensors(files.shapes, {name: hf_shape(shape, ax) for name, shape, ax in names}, source, ignore)
        return [from_hf(files.get_tensor(name, dtypes.get(name, dtype)), shape, ax) for name, shape, ax in names]


def named_hf_tensors(named: Iterable[tuple[str, np.ndarray, int]]) -> dict[str, np.ndarray]:
    """(HF name, weight in our layout, in_axes) -> {HF name: contiguous tensor in HF layout}."""
    return {name: np.ascontiguousarray(to_hf(value, in_axes)) for name, value, in_axes in named}


def write_checkpoint_dir(
    path: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], tokenizer: Any = None,
    json_files: dict[str, Any] | None = None,
) -> Path:
    """Atomically (re)place `path` with config.json + model.safetensors (+ tokenizer files, + each
    `json_files` name's JSON, e.g. generation_config.json): everything is written to a temporary
    sibling dir that is renamed into place when complete."""
    from safetensors.numpy import save_file

    with atomic_path(path, directory=True) as tmp:
        for name, content in {"config.json": config, **(json_files or {})}.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it owner-only
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return path


def load_hf_tokenizer(directory: Path) -> Any:
    """The dir's fast tokenizer, or None when it ships none. Does not import torch."""
    if not (directory / "tokenizer.json").exists():
        return None
    # PreTrainedTokenizerFast reads tokenizer_config.json (special tokens, chat template) too;
    # AutoTokenizer would import torch.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))
