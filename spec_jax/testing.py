"""Conformance checks for a model you bring as the target (`spec_jax.models.TargetModel`).

    from spec_jax.testing import check_target
    check_target(MyModel(...), params)        # raises TargetCheckError naming what broke

Each check is one property of the contract in `spec_jax.models.interface`, run on tiny inputs
(two rows of different lengths, a few tokens, a three-node tree) so it takes seconds. The first
property that fails raises `TargetCheckError` with its name, what was seen, and how to fix it;
on success the names of the passed checks come back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.interface import CacheReader, TargetModel, ancestor_mask
from spec_jax.models.resolve import as_target_model

# Host callbacks in lowered StableHLO (jax.pure_callback, io_callback, jax.debug.print/callback):
# custom calls such as @xla_ffi_python_cpu_callback / @xla_python_gpu_callback.
_HOST_CALLBACK = re.compile(r"custom_call\s*@[\w.]*callback\w*")


class TargetCheckError(AssertionError):
    """A target model broke one property of the target interface; `.check` names it."""

    def __init__(self, check: str, message: str):
        super().__init__(f"check_target: {check}: {message}")
        self.check = check


@dataclasses.dataclass(frozen=True)
class _Probe:
    """The inputs every check shares: two rows, row 1 shorter than row 0."""

    tokens: np.ndarray  # [2, T] int32
    prefix: np.ndarray  # [2] committed prefix per row before stepping
    capacity: int


def _fail(check: str, message: str) -> None:
    raise TargetCheckError(check, message)


def _close(a: Any, b: Any, atol: float, rtol: float) -> tuple[bool, float]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    return bool(np.allclose(a, b, atol=atol, rtol=rtol)), diff


def check_target(
    model: Any,
    params: Any,
    *,
    capture: Sequence[int] | None = None,
    seq_len: int = 12,
    capacity: int = 32,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    seed: int = 0,
    check_positions: bool = True,
) -> list[str]:
    """Check that `model` (with `params`) meets the target interface; returns the passed checks.

    capture: layer ids to check capturing with (default: the first and the last layer).
    atol/rtol: how close a cached pass must be to the full forward (float32 models: 1e-4;
      loosen for bfloat16).
    check_positions: False for a model with no positional encoding at all (then shifting the
      positions rightly changes nothing).
    """
    if seq_len < 8:
        raise ValueError(f"check_target needs seq_len >= 8, got {seq_len}.")
    model = _check_interface(model)
    passed = ["interface"]
    layers = int(model.num_layers)
    capture = tuple(capture) if capture is not None else tuple(sorted({0, layers - 1}))
    rng = np.random.default_rng(seed)
    probe = _Probe(
        tokens=rng.integers(0, int(model.vocab_size), (2, seq_len)).astype(np.int32),
        prefix=np.asarray([seq_len // 2, seq_len // 2 - 3], np.int32),
        capacity=capacity,
    )
    checker = _Checker(model, params, probe, capture, atol, rtol)
    checker.traces_under_jit()
    passed.append("traces under jit")
    full_logits = checker.full_forward()
    passed += ["float32 logits", "captured layers"]
    cache, pos = checker.prefill_then_steps(full_logits)
    passed += ["prefill then steps equals full forward", "per-row writes"]
    if isinstance(model, CacheReader):
        checker.cache_view(cache, pos, np.random.default_rng(seed + 1))
        passed.append("cache view")
    checker.rollback_by_length(full_logits, cache, pos, rng)
    passed.append("rollback by length")
    checker.partial_rollback(full_logits, rng)
    passed.append("rollback after a partly accepted draft")
    if check_positions:
        checker.positions_honoured(cache, pos)
        passed.append("positions honoured")
    _check_tree(checker)
    passed += ["tree mask equals chains", "tree commit"]
    return passed


def _check_interface(model: Any) -> TargetModel:
    """1. The object: a static, hashable TargetModel (a built-in ModelConfig is wrapped)."""
    if isinstance(model, ModelConfig):
        model = as_target_model(model)
    if not isinstance(model, TargetModel):
        missing = [n for n in ("vocab_size", "hidden_size", "num_layers", "max_positions", "stop_ids",
                               "init_cache", "cache_lengths", "forward", "logits", "embed", "commit",
                               "weight_specs") if not hasattr(model, n)]
        _fail("interface", f"{type(model).__name__} lacks {missing}; implement every member of "
              "spec_jax.models.TargetModel.")
    try:
        hash(model)
    except TypeError as e:
        _fail("hashable", f"{type(model).__name__} is not hashable ({e}): it is a static argument of "
              "jax.jit. Use a frozen dataclass holding only static configuration; pass arrays as params.")
    return model


class _Checker:
    """The numbered checks 2-6 on one model and probe; each raises TargetCheckError on failure."""

    def __init__(self, model: TargetModel, params: Any, probe: _Probe, capture: tuple[int, ...],
                 atol: float, rtol: float):
        self.model, self.params, self.probe, self.capture = model, params, probe, capture
        self.atol, self.rtol = atol, rtol
        seq_len = probe.tokens.shape[1]
        self.positions_full = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (2, seq_len))
        self._forward = jax.jit(self._raw_forward, static_argnames="capture")
        # commit under jit, as the loop runs it: eagerly, each op of a many-layer cache's commit
        # compiles on its own (over a hundred tiny programs for a 2-layer Qwen3.5).
        self.commit = jax.jit(model.commit)

    def _raw_forward(self, params, tokens, positions, cache, mask, capture):
        return self.model.forward(params, tokens, positions, cache, mask=mask, capture=capture)

    def run(self, tokens, positions, cache, mask=None, capture=()):
        return self._forward(self.params, jnp.asarray(tokens, jnp.int32),
                             jnp.asarray(positions, jnp.int32), cache, mask, capture)

    def empty_cache(self):
        return self.model.init_cache(2, self.probe.capacity)

    def traces_under_jit(self) -> None:
        """2. It traces under jit with no host callbacks (the whole loop is one XLA program)."""
        model, capture = self.model, self.capture

        def whole_pass(params, tokens, positions):
            out = model.forward(params, tokens, positions, self.empty_cache(), capture=capture)
            return model.logits(params, out.hidden), out.captured

        try:
            lowered = jax.jit(whole_pass).lower(self.params, jnp.asarray(self.probe.tokens),
                                                self.positions_full)
        except Exception as e:  # noqa: BLE001 - any tracing failure is the finding
            _fail("traces under jit", f"tracing forward under jax.jit failed: {type(e).__name__}: {e}. "
                  "Use jax.numpy / lax only, no Python branches on array values, no .item() / np.asarray "
                  "of traced values.")
        found = sorted(set(_HOST_CALLBACK.findall(lowered.as_text())))
        if found:
            _fail("no host callbacks", f"the lowered forward calls back to the host ({found}): "
                  "jax.pure_callback, io_callback or jax.debug.print/callback inside forward stall "
                  "every step of the on-device loop. Remove them from the model.")

    def full_forward(self) -> np.ndarray:
        """3. Full forward: shapes, float32 logits, captured layers; returns its logits [2, T, V]."""
        model, params, capture, tokens = self.model, self.params, self.capture, self.probe.tokens
        seq_len, hidden_size, vocab = tokens.shape[1], int(model.hidden_size), int(model.vocab_size)
        full = self.run(tokens, self.positions_full, self.empty_cache(), capture=capture)
        if tuple(full.hidden.shape) != (2, seq_len, hidden_size):
            _fail("hidden shape", f"forward returned hidden {tuple(full.hidden.shape)}, expected "
                  f"[B, T, hidden_size] = {(2, seq_len, hidden_size)}.")
        logits = model.logits(params, full.hidden)
        if logits.dtype != jnp.float32:
            _fail("float32 logits", f"logits are {logits.dtype}; acceptance compares probabilities, "
                  "so return float32 (e.g. preferred_element_type=jnp.float32 in the head's dot, or "
                  ".astype(jnp.float32)).")
        if tuple(logits.shape) != (2, seq_len, vocab):
            _fail("logits shape", f"logits {tuple(logits.shape)}, expected [B, T, vocab_size] = "
                  f"{(2, seq_len, vocab)}.")
        self._captured_layers(full.captured)
        embeds = model.embed(params, jnp.asarray(tokens))
        if tuple(embeds.shape) != (2, seq_len, hidden_size):
            _fail("embed shape", f"embed returned {tuple(embeds.shape)}, expected [B, T, hidden_size].")
        lengths0 = np.asarray(model.cache_lengths(self.empty_cache()))
        if lengths0.shape != (2,) or lengths0.any():
            _fail("empty cache", f"init_cache(2, capacity) has lengths {lengths0.tolist()}, expected [0, 0].")
        if np.asarray(model.cache_lengths(full.cache)).any():
            _fail("forward leaves lengths", "forward changed the committed lengths; only commit may: "
                  "a verify pass must not commit drafts that may be rejected.")
        return np.asarray(logits)

    def _captured_layers(self, captured: jax.Array | None) -> None:
        capture, hidden_size = self.capture, int(self.model.hidden_size)
        want = (2, self.probe.tokens.shape[1], len(capture) * hidden_size)
        if captured is None or tuple(captured.shape) != want:
            got = None if captured is None else tuple(captured.shape)
            _fail("captured layers", f"capture={capture} returned {got}, expected [B, T, "
                  f"len(capture) * hidden_size] = {want}: the hidden states after each requested layer, "
                  "concatenated on the last axis in the requested order.")
        if capture:
            one = self.run(self.probe.tokens, self.positions_full, self.empty_cache(),
                           capture=capture[-1:])
            same, diff = _close(one.captured, captured[..., -hidden_size:], self.atol, self.rtol)
            if not same:
                _fail("captured layers", f"layer {capture[-1]} captured alone differs from its slot in "
                      f"capture={capture} (max diff {diff:.2e}): keep the requested order.")

    def step_matches_full(self, full_logits: np.ndarray, cache, pos: np.ndarray, check: str, fix: str):
        """One token per row at its own position `pos` [2]: its logits must equal the full pass."""
        out = self.run(self.probe.tokens[np.arange(2), pos][:, None], pos[:, None], cache)
        step = np.asarray(self.model.logits(self.params, out.hidden))[:, 0]
        for b in range(2):
            same, diff = _close(step[b], full_logits[b, pos[b]], self.atol, self.rtol)
            if not same:
                _fail(check, f"row {b} at position {pos[b]}: {fix.format(diff=diff)}")
        return out

    def prefill_then_steps(self, full_logits: np.ndarray) -> tuple[Any, np.ndarray]:
        """4. Prefill, then one-token steps at each row's own position, equals the full forward.
        Returns the cache after the steps and the next position of each row."""
        model, prefix, seq_len = self.model, self.probe.prefix, self.probe.tokens.shape[1]
        cache = self.run(self.probe.tokens[:, : prefix.max()], self.positions_full[:, : prefix.max()],
                         self.empty_cache()).cache
        cache = self.commit(cache, jnp.asarray(prefix))
        if np.asarray(model.cache_lengths(cache)).tolist() != prefix.tolist():
            _fail("commit lengths", f"after commit(cache, {prefix.tolist()}) cache_lengths is "
                  f"{np.asarray(model.cache_lengths(cache)).tolist()}.")
        pos = prefix.copy()
        for _ in range(min(4, seq_len - 1 - int(prefix.max()))):  # leaves one position for step 5
            out = self.step_matches_full(
                full_logits, cache, pos, "per-row writes",
                "a cached one-token step differs from the full forward (max diff {diff:.2e}). Each row "
                "must write its keys/values at its own slot cache_lengths[b] (not one shared index), "
                "read only its committed slots, and rotate by the given positions.")
            pos = pos + 1
            cache = self.commit(out.cache, jnp.asarray(pos))
        return cache, pos

    def rollback_by_length(self, full_logits: np.ndarray, cache, pos: np.ndarray,
                           rng: np.random.Generator) -> None:
        """5. Rejected drafts roll back by length: junk written past the committed length is unseen."""
        junk = rng.integers(0, int(self.model.vocab_size), (2, 3)).astype(np.int32)
        out = self.run(junk, pos[:, None] + np.arange(3), cache)
        rolled = self.commit(out.cache, jnp.asarray(pos))  # keep nothing of the junk pass
        self.step_matches_full(
            full_logits, rolled, pos, "rollback by length",
            "after a pass that was not committed, the next step differs from the full forward (max diff "
            "{diff:.2e}). Attend only to slots below cache_lengths, so uncommitted keys/values are never "
            "seen.")

    def partial_rollback(self, full_logits: np.ndarray, rng: np.random.Generator) -> None:
        """5b. A pass of [two true tokens, junk] committed two tokens in: the next step equals the
        full forward. A recurrent layer must restore its state after the second token, not the
        state after the whole pass (nor the one before it)."""
        model, prefix = self.model, self.probe.prefix
        cache = self.run(self.probe.tokens[:, : prefix.max()], self.positions_full[:, : prefix.max()],
                         self.empty_cache()).cache
        cache = self.commit(cache, jnp.asarray(prefix))
        rows = np.arange(2)
        true = self.probe.tokens[rows[:, None], prefix[:, None] + np.arange(2)]
        junk = rng.integers(0, int(model.vocab_size), (2, 1)).astype(np.int32)
        out = self.run(np.concatenate([true, junk], axis=1), prefix[:, None] + np.arange(3), cache)
        kept = self.commit(out.cache, jnp.asarray(prefix + 2))
        self.step_matches_full(
            full_logits, kept, prefix + 2, "rollback after a partly accepted draft",
            "after a 3-token pass of which 2 tokens were committed, the next step differs from the "
            "full forward (max diff {diff:.2e}). A recurrent layer's commit must restore, per row, "
            "the state after its last committed token (docs/bring_your_own_model.md, recurrent layers).")

    def cache_view(self, cache, pos: np.ndarray, rng: np.random.Generator) -> None:
        """8. A model that offers `cache_view` (drafters that read its cache): one layer type per
        layer; each attention type's last layer's view is the cache's own arrays (no copy) with
        its committed lengths, committed slot j holds position j (the same keys/values as one
        full pass over those tokens), and a pass that was not committed changes no committed slot."""
        model, capacity = self.model, self.probe.capacity
        types = tuple(model.layer_types)
        if len(types) != model.num_layers:
            _fail("cache view", f"layer_types has {len(types)} entries for {model.num_layers} layers.")
        full = self.run(self.probe.tokens[:, : pos.max()], self.positions_full[:, : pos.max()], self.empty_cache())
        full_cache = self.commit(full.cache, jnp.asarray(pos))
        junk = rng.integers(0, int(model.vocab_size), (2, 2)).astype(np.int32)
        after_junk = self.run(junk, pos[:, None] + np.arange(2), cache).cache
        for kind in ("sliding_attention", "full_attention"):
            if kind not in types:
                continue
            layer = len(types) - 1 - types[::-1].index(kind)
            view = model.cache_view(cache, layer)
            leaves = jax.tree_util.tree_leaves(cache)
            if not any(view.k is leaf for leaf in leaves) or not any(view.v is leaf for leaf in leaves):
                _fail("cache view", f"cache_view(cache, {layer}) returned new arrays: return the cache's own "
                      "keys/values arrays (a view the loop reads in place, never a copy or a slice).")
            shape = tuple(view.k.shape)
            if len(shape) != 4 or shape[0] != 2 or shape[2] != capacity or tuple(view.v.shape) != shape:
                _fail("cache view", f"layer {layer}'s view has k {shape}, v {tuple(view.v.shape)}; expected "
                      f"[B, Kv, capacity, D] = [2, Kv, {capacity}, D] for both.")
            if np.asarray(view.lengths).tolist() != pos.tolist():
                _fail("cache view", f"the view's lengths {np.asarray(view.lengths).tolist()} differ from the "
                      f"committed lengths {pos.tolist()}.")
            reference = model.cache_view(full_cache, layer)
            for name, got, want, moved in (("keys", view.k, reference.k, model.cache_view(after_junk, layer).k),
                                           ("values", view.v, reference.v, model.cache_view(after_junk, layer).v)):
                for b in range(2):
                    committed = slice(0, int(pos[b]))
                    same, diff = _close(got[b, :, committed], want[b, :, committed], self.atol, self.rtol)
                    kept, _ = _close(moved[b, :, committed], got[b, :, committed], 0, 0)
                    if not same or not kept:
                        _fail("cache view", f"layer {layer} ({kind}), row {b}: the committed {name} "
                              + (f"differ from one full pass over the same tokens (max diff {diff:.2e}): slot j "
                                 "must hold position j's." if not same else
                                 "changed under a pass that was not committed."))

    def positions_honoured(self, cache, pos: np.ndarray) -> None:
        """6. The same step at positions shifted past the slots must change the output (a model
        that rotates by slot index would not notice; token trees rely on it)."""
        token = self.probe.tokens[np.arange(2), pos][:, None]
        step = self.run(token, pos[:, None], cache)
        shifted = self.run(token, pos[:, None] + 3, cache)
        logits = self.model.logits
        same, _ = _close(logits(self.params, step.hidden), logits(self.params, shifted.hidden), 1e-6, 0)
        if same:
            _fail("positions honoured", "a pass at positions 3 past its slots gave the same output as "
                  "at its slots: the model ignores `positions` (rotating by slot index or a counter "
                  "of its own). Apply RoPE at the given positions; a token tree writes node i at slot "
                  "start + i but puts it at position start + depth. (A model with no positional "
                  "encoding at all: pass check_positions=False.)")


def _check_tree(checker: _Checker) -> None:
    """7. A tree pass equals the chain passes of its branches, and commit keeps the chosen path.

    root r -> {a, b}, a -> c: nodes [r, a, b, c] at depths [0, 1, 1, 2]; each node's output
    must equal the chain pass of its own branch ([r, a, c] or [r, b]) after the same prefix."""
    model, params, probe, run = checker.model, checker.params, checker.probe, checker.run
    commit, atol, rtol = checker.commit, checker.atol, checker.rtol
    start = probe.prefix  # [2] committed lengths; the root sits at position `start`
    base = run(probe.tokens[:, : start.max()],
               jnp.broadcast_to(jnp.arange(start.max(), dtype=jnp.int32), (2, start.max())),
               checker.empty_cache()).cache
    base = commit(base, jnp.asarray(start))
    rng = np.random.default_rng(1)
    r = probe.tokens[np.arange(2), start]
    a, b, c = (rng.integers(0, model.vocab_size, 2).astype(np.int32) for _ in range(3))
    nodes = np.stack([r, a, b, c], axis=1)  # [2, 4]
    parents = jnp.asarray([[-1, 0, 0, 1]] * 2, jnp.int32)
    depths = np.asarray([0, 1, 1, 2], np.int32)
    tree = run(nodes, start[:, None] + depths, base, mask=ancestor_mask(parents))
    tree_logits = np.asarray(model.logits(params, tree.hidden))

    def chain(tokens):
        out = run(tokens, start[:, None] + np.arange(tokens.shape[1]), base)
        return np.asarray(model.logits(params, out.hidden)), out

    chain_ac, out_ac = chain(np.stack([r, a, c], axis=1))
    chain_b, out_b = chain(np.stack([r, b], axis=1))
    for node, ref, what in ((0, chain_ac[:, 0], "root"), (1, chain_ac[:, 1], "node a"),
                            (3, chain_ac[:, 2], "node c (child of a)"), (2, chain_b[:, 1], "node b")):
        same, diff = _close(tree_logits[:, node], ref, atol, rtol)
        if not same:
            _fail("tree mask equals chains", f"{what} of a tree pass differs from the chain pass of its "
                  f"branch (max diff {diff:.2e}). Use the in-pass `mask` [B, T, T] (node b must not see "
                  "its sibling a) and the given positions (b sits at position start + 1 though it is "
                  "written at slot start + 2), not the slot index, for RoPE.")
    nxt = rng.integers(0, model.vocab_size, 2).astype(np.int32)[:, None]
    # Keep [r, b] (b's keys/values move from slot start + 2 to start + 1), [r, a, c] and [r, a]:
    # the next step must equal the same step after committing the chain of those tokens (a
    # recurrent layer's state follows the path, not the pass order).
    for path, kept_len, chain_out in (([0, 2], 2, out_b), ([0, 1, 3], 3, out_ac), ([0, 1, 3], 2, out_ac)):
        kept = commit(tree.cache, jnp.asarray(start + kept_len), jnp.asarray([path] * 2, jnp.int32))
        after_tree = run(nxt, (start + kept_len)[:, None], kept)
        after_chain = run(nxt, (start + kept_len)[:, None], commit(chain_out.cache, jnp.asarray(start + kept_len)))
        same, diff = _close(model.logits(params, after_tree.hidden), model.logits(params, after_chain.hidden),
                            atol, rtol)
        if not same:
            _fail("tree commit", f"after commit(cache, start + {kept_len}, path={path}) the next step differs "
                  f"from the same step after the chain of those nodes (max diff {diff:.2e}). commit must "
                  "move node path[b, i]'s keys/values from slot old + path[b, i] to old + i before setting "
                  "the lengths, and a recurrent layer must take the state after node path[b, n - 1].")
