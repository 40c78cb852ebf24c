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

import pytest

from spec_jax.app import compilation_cache
from spec_jax.app.main import COMMANDS, build_parser

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
    first = json.loads(_python(argv, {}).stdout)["compilation"]
    assert first["cache_dir"] == str(cache) and any(cache.iterdir())
    assert first["programs"] == 1 and first["cache_misses"] == 1 and first["cache_hits"] == 0
    second_proc = _python(argv, {})
    second = json.loads(second_proc.stdout)["compilation"]
    assert second["programs"] == 1 and second["cache_hits"] == 1 and second["cache_misses"] == 0
    assert second["trace_seconds"] > 0
    assert re.search(r"compiled 1 program in [\d.]+s, [\d.]+s of it tracing \(1 from the persistent cache\)",
                     second_proc.stderr), second_proc.stderr
