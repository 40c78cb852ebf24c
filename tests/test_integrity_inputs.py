"""Bad inputs at the edges get one clear error: huge CLI seeds and top-k, prompts that are not
UTF-8 (arguments, JSONL strings, whole files), config.json files of the wrong shape; a damaged
GGUF cache entry of any kind is rebuilt with a warning."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from spec_jax.app.main import main
from spec_jax.checkpoints import CheckpointError
from spec_jax.checkpoints.hf import read_hf_config


def one_error(capsys, code, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err[-1] == errors[0], err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("flags, fragment", [
    (["--seed", "99999999999999999999999"], "seed must be an integer >= 0 and <= 4294967295"),
    (["--top-k", "99999999999"], "top_k must be an integer >= 0 and <= 2147483647"),
])
def test_cli_huge_sampling_values_are_one_error_line(tmp_path, capsys, flags, fragment):
    """Issue 33: these ended in OverflowError tracebacks. Checked before the target loads."""
    code = main(["generate", "--target", str(tmp_path / "never-loaded"), "--prompt-ids", "1,2", *flags])
    one_error(capsys, code, fragment)


def test_non_utf8_prompt_argument_is_one_error_line(tmp_path, capsys):
    """Python passes undecodable argv bytes as lone surrogates; tokenizers raised a TypeError."""
    text = b"caf\xe9".decode("utf-8", "surrogateescape")
    code = main(["generate", "--target", str(tmp_path / "never-loaded"), text])
    one_error(capsys, code, "prompt argument 1 is not valid UTF-8 text (byte 0xe9 at character 4)")


def test_prompt_files_name_the_line_of_bad_text(tmp_path, capsys):
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud800 here"}\n')
    code = main(["generate", "--target", str(tmp_path / "never-loaded"), "--prompt-file", str(surrogate)])
    one_error(capsys, code, "surrogate.jsonl:2 is not valid UTF-8 text (lone surrogate U+D800 at character 5)")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    code = main(["generate", "--target", str(tmp_path / "never-loaded"), "--prompt-file", str(latin1)])
    one_error(capsys, code, "latin1.jsonl:3 is not UTF-8 text (byte 0xe9 at column 16); save latin1.jsonl as UTF-8")
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    code = main(["generate", "--target", str(tmp_path / "never-loaded"), "--prompt-file", str(messages)])
    one_error(capsys, code, "messages.jsonl:1: 'messages' must be", "content are strings")


@pytest.mark.parametrize("config, fragment", [
    ([1, 2, 3], "holds a JSON list, not an object"),
    ({"model_type": "llama", "num_hidden_layers": "two"}, "num_hidden_layers must be a positive integer, got 'two'"),
    ({"model_type": "llama", "hidden_size": 64.5}, "hidden_size must be a positive integer, got 64.5"),
    ({"model_type": "llama", "rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5'"),
    ({"model_type": "llama", "rope_scaling": "llama3"}, "rope_scaling must be an object"),
])
def test_config_json_of_the_wrong_shape_names_the_field(tmp_path, config, fragment):
    """Issue 33: `[1,2,3]` and `"num_hidden_layers": "two"` ended in tracebacks."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        read_hf_config(tmp_path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from test_gguf_synthetic import SPECIALS, _write_gguf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(SPECIALS) + 256, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(transformers.LlamaForCausalLM(config).eval(), path)
    return path


@pytest.mark.parametrize("damage", ["tokenizer_json", "config_list", "config_field"])
def test_any_damage_to_a_gguf_cache_entry_rebuilds_it(tiny_gguf, tmp_path, damage):
    """Issue 33: a damaged tokenizer.json broke the default model on every run (`Expecting
    value`), a config.json that is a list gave an AttributeError."""
    import spec_jax.checkpoints as checkpoints
    from spec_jax.checkpoints import load_target

    checkpoints._load_gguf_cached.cache_clear()
    first = load_target(str(tiny_gguf), cache_dir=tmp_path)
    (entry,) = list(tmp_path.iterdir())
    if damage == "tokenizer_json":
        (entry / "tokenizer.json").write_text('{"version": ')
    elif damage == "config_list":
        (entry / "config.json").write_text("[1, 2, 3]")
    else:
        config = json.loads((entry / "config.json").read_text())
        (entry / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    checkpoints._load_gguf_cached.cache_clear()
    with pytest.warns(UserWarning, match="damaged GGUF cache"):
        rebuilt = load_target(str(tiny_gguf), cache_dir=tmp_path)
    np.testing.assert_array_equal(np.asarray(rebuilt.params["embed"]), np.asarray(first.params["embed"]))
    assert rebuilt.tokenizer.encode("hi") == first.tokenizer.encode("hi")
    checkpoints._load_gguf_cached.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry reads back cleanly
        load_target(str(tiny_gguf), cache_dir=tmp_path)
    checkpoints._load_gguf_cached.cache_clear()
