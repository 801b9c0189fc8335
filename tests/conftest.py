"""Session fixtures: the embedded model's checkpoint and tokenizer are loaded once per test run."""

from __future__ import annotations

import pytest

from ngrammar.model.loader import Checkpoint, resolve_checkpoint
from ngrammar.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def checkpoint() -> Checkpoint:
    return resolve_checkpoint(None)


@pytest.fixture(scope="session")
def tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    return Tokenizer(checkpoint.tokenizer_dir, checkpoint.config.eos_token_ids)
