"""The command line's persistent compilation cache: where it goes (flag, SPEC_JAX_COMPILATION_CACHE,
the user's JAX_COMPILATION_CACHE_DIR, the XDG default), off by flag or variable, and spec_jax's
compile counters: a second run in a fresh process loads its program from the cache (a hit).

The CLI runs in subprocesses: turning the cache on or off is per process, and this one's JAX
config must stay as conftest set it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_prompts

from spec_jax.app import compilation_cache
from spec_jax.app.main import COMMANDS, build_parser
from spec_jax.decoding import saved_programs
from spec_jax.decoding.generate import prepare_inputs, saved_loop_key
from spec_jax.decoding.programs import _CACHE_HIT as _JAX_CACHE_HIT
from spec_jax.decoding.programs import CompileTally, ProgramCache
from spec_jax.drafters.ngram import NGramDrafter

REPO = Path(__file__).parent.parent


def test_the_directory_flag_then_env_then_jax_env_then_xdg():
    home = {"XDG_CACHE_HOME": "/xdg"}
    assert compilation_cache.choose(None, home) == "/xdg/spec_jax/jax-compilation-cache"
    jax_env = dict(home, JAX_COMPILATION_CACHE_DIR="/jax")
    assert compilation_cache.choose(None, jax_env) == "/jax"  # the user's JAX setting is kept
    ours = dict(jax_env, SPEC_JAX_COMPILATION_CACHE="/ours")
    assert compilation_cache.choose(None, ours) == "/ours"
    assert compilation_cache.choose("/flag", ours) == "/flag"
    assert compilation_cache.choose("off", ours) is None
    assert compilation_cache.choose(None, dict(jax_env, SPEC_JAX_COMPILATION_CACHE="OFF")) is None
    assert compilation_cache.choose("/flag", dict(SPEC_JAX_COMPILATION_CACHE="off")) == "/flag"


def test_jax_settings_cache_small_programs_unless_the_user_said_otherwise():
    on = compilation_cache.jax_settings("/c", {})
    assert on["jax_compilation_cache_dir"] == "/c" and on["jax_enable_compilation_cache"] is True
    assert on["jax_persistent_cache_min_compile_time_secs"] == 0.0
    users = compilation_cache.jax_settings("/c", {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"})
    assert "jax_persistent_cache_min_compile_time_secs" not in users  # JAX read the user's value
    assert compilation_cache.jax_settings(None, {}) == {"jax_enable_compilation_cache": False}


def test_the_cli_compiles_without_ynn_fusions_on_cpu_unless_xla_flags_say():
    assert compilation_cache.cpu_compiler_options({}) == {"xla_cpu_experimental_ynn_fusion_type": ""}
    users = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}
    assert compilation_cache.cpu_compiler_options(users) == {}


def test_options_this_jaxlib_refuses_fall_back_to_xla_defaults():
    """The CLI's XLA:CPU options are checked once: a value this jaxlib does not know (another
    version's) leaves XLA's defaults, with a warning, instead of failing every compile."""
    good = compilation_cache.cpu_compiler_options({})
    assert compilation_cache.accepted_options(good) == good
    with pytest.warns(UserWarning, match="refused"):
        assert compilation_cache.accepted_options({"xla_cpu_experimental_ynn_fusion_type": "NO_SUCH_TYPE"}) == {}


def test_every_command_takes_the_flag(capsys):
    parser = build_parser()
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "--compile-cache DIR|off" in capsys.readouterr().out, command


def _python(args, env_changes, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_changes)
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # a fresh process (about 5 s)
def test_configure_sets_jax_in_a_fresh_process(tmp_path):
    script = """if True:
        import os, jax
        from spec_jax.app import compilation_cache as c
        os.environ["SPEC_JAX_COMPILATION_CACHE"] = "off"
        c.configure(None)
        print(jax.config.jax_enable_compilation_cache)
        os.environ.pop("SPEC_JAX_COMPILATION_CACHE"); os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        c.configure(None)
        print(jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    """
    out = _python(["-c", script], {"XDG_CACHE_HOME": str(tmp_path)}).stdout.split()
    assert out == ["False", "True", str(tmp_path / "spec_jax" / "jax-compilation-cache")]


@pytest.mark.slow  # two fresh CLI processes, the first compiling (about 30 s)
def test_a_second_run_loads_its_program_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    argv = ["-m", "spec_jax.app.main", "generate", "--target", "random:tiny", "--prompt-ids", "1,2,3",
            "--max-new-tokens", "2", "--json", "--compile-cache", str(cache)]
    first_out = json.loads(_python(argv, {}).stdout)
    first = first_out["compilation"]
    assert first["cache_dir"] == str(cache) and any(cache.iterdir())
    assert first["programs"] == 1 and first["cache_misses"] == 1 and first["cache_hits"] == 0
    second_proc = _python(argv, {})
    second = json.loads(second_proc.stdout)["compilation"]
    # Loaded whole (spec_jax-programs/): not even traced, and the same tokens.
    assert second["programs"] == 1 and second["cache_hits"] == 1 and second["cache_misses"] == 0
    assert second["saved_hits"] == 1 and second["trace_seconds"] == 0
    assert json.loads(second_proc.stdout)["results"] == first_out["results"]
    assert re.search(r"compiled 1 program in [\d.]+s, 0.0s of it tracing \(1 from the persistent cache, 1 of them "
                     r"untraced\)", second_proc.stderr), second_proc.stderr


# Saved programs (spec_jax.decoding.saved_programs): a program is loaded whole only for the exact
# call it was saved for, and anything unusable is a miss that compiles as before.


@pytest.fixture
def saved_dir(tmp_path):
    saved_programs.enable(tmp_path)
    yield tmp_path / saved_programs.SUBDIR
    saved_programs.enable(None)


def _loop_call(models, prompt_length=5, k=3, **values):
    values = dict(dict(max_new_tokens=8), **values)
    return prepare_inputs(models.target, make_prompts([prompt_length]), NGramDrafter(k=k), **values)


def _loop_key(call):
    return saved_loop_key(call.target.model, call.drafter, call.capacity, call.inputs)


@dataclasses.dataclass(frozen=True)
class _UsersConfig:  # a class whose code is not in spec_jax's source digest
    width: int = 4


def test_saved_program_keys_name_the_exact_call(models, saved_dir, monkeypatch):
    key = _loop_key(_loop_call(models)).digest
    assert _loop_key(_loop_call(models)).digest == key  # the same call, built again
    # Traced values share one program: the prompt's tokens, the seed, sampling, the token budget.
    assert _loop_key(_loop_call(models, seed=7, temperature=0.5, max_new_tokens=6)).digest == key
    # A static argument or a shape that differs misses.
    assert _loop_key(_loop_call(models, k=4)).digest != key
    assert _loop_key(_loop_call(models, capacity=128)).digest != key
    assert _loop_key(_loop_call(models, prompt_length=20)).digest != key  # the next prompt bucket
    call = _loop_call(models)
    as_f16 = jax.tree_util.tree_map(lambda x: x.astype(np.float16), call.inputs.target_params)
    assert saved_loop_key(call.target.model, call.drafter, call.capacity,
                          call.inputs.replace(target_params=as_f16)).digest != key
    # So does another cache attention for the backend (what the layers trace: a table tests switch).
    from spec_jax.models import attention

    monkeypatch.setitem(attention.LIVE_ATTENTION, jax.default_backend(), ("dense", 128))
    assert _loop_key(call).digest != key
    monkeypatch.undo()
    assert _loop_key(call).digest == key
    # Any edit of spec_jax's source misses.
    monkeypatch.setattr(saved_programs, "source_digest", lambda: "edited")
    assert _loop_key(call).digest != key
    # Not saved: statics without an exact description, a mesh, or saving off.
    assert saved_programs.key_for("f", (call.target.model, lambda x: x), (1,)) is None
    assert saved_programs.key_for("f", _UsersConfig(), (1,)) is None
    assert saved_programs.key_for("f", (), (1,), mesh="a mesh") is None
    saved_programs.enable(None)
    assert _loop_key(call) is None


@functools.partial(jax.jit, static_argnames="scale")
def _scaled(x, scale):
    return jnp.tanh(x @ x.T) * scale


def test_a_saved_program_loads_whole_and_a_bad_file_is_a_miss(saved_dir):
    # A constant new to every run: JAX's own cache cannot have it, so the first get compiles.
    scale = float(int.from_bytes(os.urandom(4), "little"))
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)

    def get(lower=lambda: _scaled.lower(x, scale=scale)):
        tally = CompileTally()
        exe, _ = ProgramCache(1).get_or_compile("scaled", lower, tally=tally, saved_as=saved_as)
        return exe, tally

    saved_as = lambda: saved_programs.key_for("scaled", scale, (x,))  # noqa: E731
    compiled, tally = get()
    assert (tally.saved_hits, tally.cache_hits) == (0, 0)
    [path] = saved_dir.iterdir()
    loaded, tally = get()
    assert (tally.saved_hits, tally.cache_hits, tally.trace_seconds) == (1, 1, 0)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))
    # A cut file, a damaged one, or one saved for another call is a miss, and is removed.
    whole, key = path.read_bytes(), saved_as()
    other = saved_programs.key_for("scaled", scale + 1, (x,))
    for path_now, data in ((path, whole[:-100]), (path, whole[:-100] + b"x" * 100),
                           (saved_dir / f"{other.digest}{saved_programs.SUFFIX}", whole)):
        path_now.write_bytes(data)
        assert saved_programs.load(key if path_now == path else other) is None
        assert not path_now.exists()
    # A program JAX's cache served is not saved: its executable would serialize without its
    # machine code.
    served = lambda: (jax.monitoring.record_event(_JAX_CACHE_HIT), _scaled.lower(x, scale=scale))[1]  # noqa: E731
    exe, _ = get(served)
    np.testing.assert_array_equal(np.asarray(exe(x)), np.asarray(compiled(x)))
    assert not any(saved_dir.iterdir())


