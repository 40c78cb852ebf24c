"""Errors a user can cause by pointing spec_jax at a bad checkpoint."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint cannot be used as given; the message names the problem and the fix."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path, file or hub id does not resolve to a checkpoint on this machine."""
