"""Streaming: `generate_stream` gives `generate`'s tokens (greedy, and sampled with the same seed,
whatever the chunk size), the incremental detokenizer gives the full decode piece by piece, and
`spec-jax generate --stream` prints the non-streamed text."""

from __future__ import annotations

import random
import time

import pytest
from conftest import make_prompts
from serving_testlib import CORPUS, make_tokenizer, save_tiny_target

from spec_jax.app.main import main
from spec_jax.decoding.generate import generate
from spec_jax.decoding.stream import IncrementalDetokenizer, generate_stream
from spec_jax.drafters.ngram import NGramDrafter

# Rows 1 and 2 meet EOS mid-way (conftest), row 0 runs to the cap: both finish kinds stream.
PROMPTS = make_prompts([3, 16, 1], seed=0)


def collect(updates):
    got, count = None, 0
    for update in updates:
        got = got or [[] for _ in update.new_ids]
        for row, ids in zip(got, update.new_ids):
            row.extend(ids)
        count += 1
    return got, update, count


@pytest.mark.parametrize("temperature, chunk_steps", [(0.0, 1), (0.8, 3)])
def test_stream_equals_generate(models, temperature, chunk_steps):
    drafter = NGramDrafter(k=3)
    kwargs = dict(max_new_tokens=24, temperature=temperature, seed=7)
    ref = generate(models.target, PROMPTS, drafter, **kwargs)
    got, last, updates = collect(generate_stream(models.target, PROMPTS, drafter, chunk_steps=chunk_steps, **kwargs))
    assert got == ref.generated_ids
    assert last.result.generated_ids == ref.generated_ids
    assert last.result.finish_reasons == ref.finish_reasons == last.finish_reasons
    assert last.result.stats == ref.stats and last.result.loop_steps == ref.loop_steps
    assert updates >= -(-ref.loop_steps // chunk_steps)  # one update per chunk, plus prefill's
    assert set(ref.finish_reasons) == {"stop", "length"}


@pytest.mark.parametrize("kind", ["self", None])
def test_stream_hands_out_full_chunks(models, drafters, kind):
    """Every draft accepted (the target as its own drafter), and plain decoding: each chunk
    commits the most tokens it can, all of the window an update reads (`decoding.emitted`)."""
    drafter, params = (None, None) if kind is None else (drafters[kind][0](3), drafters[kind][1])
    kwargs = dict(max_new_tokens=30, ignore_eos=True)
    ref = generate(models.target, PROMPTS, drafter, params, **kwargs)
    got, last, _ = collect(generate_stream(models.target, PROMPTS, drafter, params, chunk_steps=2, **kwargs))
    assert got == ref.generated_ids and all(len(ids) == 30 for ids in got)
    if kind is not None:
        assert ref.stats.accepted == ref.stats.drafted


def test_streams_generation_seconds_leave_the_chunks_compile_out(models, monkeypatch):
    """The chunk program compiles after the prefill ran (its state is the argument): its seconds
    are compile's, not generation's. Here its compile is made to take 0.5 s more; generation,
    24 tokens of the tiny model, stays under that (it once counted the compile: `spec-jax
    generate --stream` reported 5 tok/s where plain `generate` reported 140)."""
    from spec_jax.decoding import stream

    real = stream.compiled

    def slow_chunk(jitted, *args, **kwargs):
        exe, seconds = real(jitted, *args, **kwargs)
        if jitted is stream.chunk_jit:
            time.sleep(0.5)
            seconds += 0.5
        return exe, seconds

    monkeypatch.setattr(stream, "compiled", slow_chunk)
    *_, last = generate_stream(models.target, PROMPTS, NGramDrafter(k=3), max_new_tokens=24)
    assert last.result.compile_s >= 0.5 and last.result.generate_s < 0.5, last.result


def test_stream_checks_arguments_before_compiling(models):
    with pytest.raises(ValueError, match="chunk_steps"):
        generate_stream(models.target, PROMPTS, chunk_steps=0)
    with pytest.raises(ValueError, match="top_p"):
        generate_stream(models.target, PROMPTS, top_p=0.0)


def test_incremental_detokenizer_matches_full_decode():
    tok = make_tokenizer()
    ids = tok.encode("".join(CORPUS))
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # halves of multi-byte characters
    rng = random.Random(0)
    for _ in range(20):
        detok, text, i = IncrementalDetokenizer(tok), "", 0
        while i < len(ids):
            n = rng.randint(0, 4)
            piece = detok.push(ids[i : i + n])
            assert "\ufffd" not in piece
            text += piece
            i += n
        assert text + detok.flush() == tok.decode(ids)


def test_cli_stream_prints_the_generated_text(tmp_path, capsys):
    """The printed text is the decode of the non-streamed tokens (`generate_stream`'s result is
    `generate`'s, above; called here in-process it reuses the programs the command compiled)."""
    from spec_jax.checkpoints import apply_chat_template, load_target

    directory = save_tiny_target(tmp_path / "tiny")
    argv = ["generate", "--target", str(directory), "--dtype", "float32", "--max-new-tokens", "20",
            "--drafter", "ngram", "Café 日本"]
    assert main(argv + ["--stream"]) == 0
    out, err = capsys.readouterr()
    target = load_target(str(directory), dtype="float32")
    prompt = apply_chat_template(target.tokenizer, "Café 日本", target.chat_template)  # as the CLI does
    *_, last = generate_stream(target, [prompt], NGramDrafter(k=4), max_new_tokens=20)
    expected = target.tokenizer.decode(last.result.generated_ids[0], skip_special_tokens=True)
    assert out == expected + "\n" and "tau" in err and len(last.result.generated_ids[0]) > 1
    assert main(argv + ["--stream", "--json"]) == 2
    assert "pick one" in capsys.readouterr().err
    assert main(argv + ["--stream", "--prompt-ids", "1,2"]) == 2
    assert "one prompt" in capsys.readouterr().err
