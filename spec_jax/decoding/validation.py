"""Host-side checks of what a caller hands `generate`, run before anything is traced or compiled.

Pure functions: each returns the value in the form the loop wants (plain ints, lists of int lists)
or raises a ValueError that names the parameter, what was wrong and how to fix it. A value that
would be converted silently into something else (5.7 -> 5, True -> 1, a seed past 32 bits) is
refused rather than converted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import numpy as np

INT32_MAX = 2**31 - 1
SEED_MAX = 2**32 - 1  # jax.random.key keeps 32 bits: larger seeds would collide with smaller ones

_ENCODE_HINT = (
    "encode text first, e.g. spec_jax.apply_chat_template(target.tokenizer, text, target.chat_template)"
)


class ArgumentError(ValueError):
    """A bad argument; `param` names it (the HTTP API maps it to the request field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _integer(value: Any) -> int | None:
    """value as a Python int when it is an integer (Python, NumPy or 0-d array; not a bool), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(value, "shape", None) == () and np.dtype(dtype).kind in "iu":
        return int(value)
    return None


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int = INT32_MAX) -> int:
    """An integer parameter in [minimum, maximum]; an integral float (4.0) is accepted, NaN, inf,
    fractions, bools and strings are not."""
    as_int = _integer(value)
    if as_int is None and isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        as_int = int(value)
    if as_int is None:
        raise ArgumentError(name, f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    if (minimum is not None and as_int < minimum) or as_int > maximum:
        low = "" if minimum is None else f" >= {minimum}"
        raise ArgumentError(name, f"{name} must be an integer{low} and <= {maximum}, got {as_int}.")
    return as_int


def check_real(name: str, value: Any, minimum: float | None = None, maximum: float | None = None) -> float:
    """A finite real number (not a bool or string; a 0-d NumPy/JAX array is one) in [minimum, maximum]."""
    dtype = getattr(value, "dtype", None)
    scalar_array = dtype is not None and getattr(value, "shape", None) == () and np.dtype(dtype).kind in "fiu"
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or scalar_array):
        raise ArgumentError(name, f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        low = "" if minimum is None else f" >= {minimum}"
        raise ArgumentError(name, f"{name} must be a finite number{low}, got {value}.")
    if maximum is not None and value > maximum:
        raise ArgumentError(name, f"{name} must be <= {maximum}, got {value}.")
    return value


def check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> dict[str, Any]:
    """The sampling arguments of `generate` as plain Python numbers."""
    checked = dict(
        max_new_tokens=check_int("max_new_tokens", max_new_tokens, minimum=1),
        temperature=check_real("temperature", temperature, minimum=0.0),
        top_k=check_int("top_k", top_k, minimum=0),
        top_p=check_real("top_p", top_p),
        seed=check_int("seed", seed, minimum=0, maximum=SEED_MAX),
    )
    if not 0.0 < checked["top_p"] <= 1.0:
        raise ArgumentError("top_p", f"top_p must be in (0, 1] (1 = off), got {top_p}.")
    return checked


def _is_array(value: Any) -> bool:
    """A NumPy or JAX array (not a list)."""
    return isinstance(value, np.ndarray) or (hasattr(value, "__array__") and hasattr(value, "dtype"))


def _id_row(row: Any, what: str, param: str) -> list[int]:
    """One list of token ids; `what` names it in errors ("prompt 3", "stop_ids"), `param` is its parameter."""
    if isinstance(row, (str, bytes)):
        raise ArgumentError(param, f"{what} is a string ({row[:40]!r}); token ids are integers: {_ENCODE_HINT}.")
    if _is_array(row):
        array = np.asarray(row)
        if array.ndim == 1 and array.dtype.kind in "iu":
            return [int(t) for t in array]
        if array.ndim != 1:
            raise ArgumentError(
                param, f"{what} must be a 1-D list of token ids, got an array of shape {array.shape}."
            )
        row = array.tolist()
    try:
        items = list(row)
    except TypeError:
        raise ArgumentError(
            param, f"{what} must be a list of integer token ids, got {row!r} ({type(row).__name__})."
        ) from None
    ids = []
    for position, token in enumerate(items):
        as_int = _integer(token)
        if as_int is None:
            raise ArgumentError(
                param, f"{what} holds {token!r} ({type(token).__name__}) at position {position}, which is not an "
                "integer token id; pass integer ids (floats, bools and strings are not converted)."
            )
        ids.append(as_int)
    return ids


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """Prompts as a list of token-id lists, every id inside the vocabulary."""
    if isinstance(prompts, (str, bytes)):
        raise ArgumentError(
            "prompts", f"prompts must be a list of token-id lists (one list per prompt), got a string; {_ENCODE_HINT}, "
            "and pass [ids]."
        )
    if _is_array(prompts):
        if np.ndim(prompts) != 2:
            raise ArgumentError(
                "prompts", f"prompts as an array must be 2-D [batch, length] token ids, got shape {np.shape(prompts)}; "
                "for one prompt pass [ids]."
            )
        prompts = list(np.asarray(prompts))
    try:
        rows = list(prompts)
    except TypeError:
        raise ArgumentError(
            "prompts", f"prompts must be a list of token-id lists, got {type(prompts).__name__}; for one prompt pass [ids]."
        ) from None
    if not rows:
        raise ArgumentError("prompts", "No prompts given: pass at least one prompt.")
    if all(_integer(r) is not None for r in rows):
        raise ArgumentError(
            "prompts", f"prompts is one flat list of ids ({rows[:5]}...); prompts are a list of token-id lists: "
            "for one prompt pass [ids]."
        )
    checked = []
    for i, row in enumerate(rows):
        ids = _id_row(row, f"Prompt {i}", "prompts")
        if not ids:
            raise ArgumentError("prompts", f"Prompt {i} is empty: every prompt needs at least one token.")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ArgumentError(
                "prompts", f"Prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})."
            )
        checked.append(ids)
    return checked


def check_stop_ids(stop_ids: Any) -> list[int]:
    """User-given stop ids: a list of non-negative integers (int32), duplicates dropped."""
    if _integer(stop_ids) is not None:
        raise ArgumentError(
            "stop_ids", f"stop_ids must be a list of token ids, got the single id {stop_ids!r}; pass [{stop_ids}]."
        )
    ids = _id_row(stop_ids, "stop_ids", "stop_ids")
    bad = [t for t in ids if not 0 <= t <= INT32_MAX]
    if bad:
        raise ArgumentError("stop_ids", f"stop_ids {bad[:5]} are not token ids (ids are integers in [0, {INT32_MAX}]).")
    return list(dict.fromkeys(ids))


def resolve_stop_ids(
    default_ids: Sequence[int], stop_ids: Any = None, ignore_eos: bool = False, extra_stop_ids: Any = ()
) -> tuple[int, ...]:
    """The one stop-id rule, for `generate`, the stream, the engine and the HTTP API alike.

    Generation stops at `stop_ids` when given, else at the model's `default_ids` (EOS and its chat
    template's end of turn); `ignore_eos` drops the defaults, never ids the caller named.
    `extra_stop_ids` are stopped at in any case: the HTTP API's `stop_token_ids`, which add to
    the defaults as vLLM's do. -> checked ids, duplicates dropped, at most MAX_STOP_IDS."""
    from spec_jax.decoding.loop import MAX_STOP_IDS

    if stop_ids is not None:
        base = check_stop_ids(stop_ids)
    else:
        base = () if ignore_eos else default_ids
    ids = list(dict.fromkeys(check_stop_ids(extra_stop_ids) + [int(t) for t in base]))
    if len(ids) > MAX_STOP_IDS:
        raise ArgumentError("stop_ids", f"At most {MAX_STOP_IDS} stop ids are supported, got {len(ids)}.")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class RequestValues:
    """One generation request's values, checked (see `check_request_values`)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]

    @property
    def sampling(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p), as `SamplingParams.create` takes them."""
        return self.temperature, self.top_k, self.top_p


def check_request_values(
    default_stop_ids: Sequence[int],
    *,
    max_new_tokens: Any = 128,
    temperature: Any = 0.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    seed: Any = 0,
    stop_ids: Any = None,
    ignore_eos: bool = False,
) -> RequestValues:
    """The sampling values, length cap and stop ids of one request, checked the same way for every
    entry point (`generate`, `generate_stream`, `Engine.check_request`, the HTTP API, `bench`):
    ArgumentError naming the parameter. Stop ids follow `resolve_stop_ids`."""
    checked = check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    return RequestValues(stop_ids=resolve_stop_ids(default_stop_ids, stop_ids, ignore_eos), **checked)


def check_capacity(capacity: Any) -> int | None:
    return None if capacity is None else check_int("capacity", capacity, minimum=1)


def check_k(k: Any) -> int | None:
    return None if k is None else check_int("k", k)  # its range is the drafter's check


def check_mesh(mesh: Any) -> None:
    from jax.sharding import Mesh

    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh or None, got {mesh!r} ({type(mesh).__name__}); build one with "
            "spec_jax.sharding.make_mesh('data=D,model=M')."
        )


def check_drafter_params(drafter: Any, params: Any) -> None:
    """`params` must have the drafter's weights (`drafter.weight_specs()`): the same tree, shapes,
    floating-point weights and integer vocabulary maps (`d2t`, `token_ordering`). Nothing is
    checked for a drafter whose weight_specs() is None."""
    if drafter is None:
        return
    import jax

    from spec_jax.models.weights import is_spec

    name = type(drafter).__name__
    fix = (f"pass the params made for this drafter config: load its checkpoint (spec_jax.load_drafter, "
           f"load_dflash, load_eagle3, load_hf_dir) together with the {name} it describes.")
    specs = drafter.weight_specs()
    if specs is None:  # no weights (n-gram), or a user model that does not describe its own
        return
    if params is None:
        raise ValueError(f"{name} needs its params, got drafter_params=None; {fix}")
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    flat_params = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for path, spec in flat_specs:
        key = jax.tree_util.keystr(path)
        if key not in flat_params:
            raise ValueError(f"{name} params lack the weight {key} (expected shape {spec.shape}); {fix}")
        leaf = flat_params[key]
        found = tuple(np.shape(leaf)) if hasattr(leaf, "shape") or isinstance(leaf, (list, tuple)) else None
        if found != tuple(spec.shape):
            raise ValueError(
                f"{name} params do not fit the drafter: weight {key} expected shape {tuple(spec.shape)}, "
                f"found {found if found is not None else type(leaf).__name__}; {fix}"
            )
        dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        # The reduced vocabulary's offsets, the Gemma 4 assistant's token ordering and the suffix
        # drafter's store are ints.
        integer = key.endswith(("['d2t']", "['token_ordering']", ".suffix_store"))
        if not (np.issubdtype(dtype, np.integer) if integer else _is_float(dtype)):
            want = "integer" if integer else "floating-point"
            raise ValueError(f"{name} params: weight {key} must be {want}, found {dtype}; {fix}")
    known = {jax.tree_util.keystr(p) for p, _ in flat_specs}
    extra = [k for k in flat_params if k not in known]
    if extra:
        raise ValueError(f"{name} params hold {extra[0]}, which the drafter has no weight for; {fix}")


def _is_float(dtype: np.dtype) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))

