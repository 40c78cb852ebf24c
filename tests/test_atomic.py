"""The one atomic-write helper every checkpoint save and training file uses."""

import os

import pytest

from spec_jax.checkpoints.atomic import atomic_path, write_atomic, write_json_atomic


def test_two_writers_get_distinct_temporary_names(tmp_path):
    target = tmp_path / "model.safetensors"
    with atomic_path(target) as first, atomic_path(target) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_bytes(b"one")
        second.write_bytes(b"two")
    assert target.read_bytes() == b"one"  # the outer block finished last
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "log.json"
    write_json_atomic(target, {"step": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == '{\n "step": 1\n}'
    assert os.listdir(tmp_path) == ["log.json"]


def test_a_directory_is_replaced_whole(tmp_path):
    target = tmp_path / "ckpt"
    for contents in ("old", "new"):
        with atomic_path(target, directory=True) as tmp:
            (tmp / "config.json").write_text(contents)
    assert sorted(os.listdir(target)) == ["config.json"] and (target / "config.json").read_text() == "new"
    assert os.listdir(tmp_path) == ["ckpt"]
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o755)


def test_write_atomic_binary_file_is_world_readable(tmp_path):
    target = tmp_path / "curve.png"
    write_atomic(target, lambda f: f.write(b"\x89PNG"))
    assert target.read_bytes() == b"\x89PNG" and oct(os.stat(target).st_mode & 0o777) == oct(0o644)
