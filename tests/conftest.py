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


@pytest.fixture(scope="session")
def llm():  # type: ignore[no-untyped-def]
    """The plain engine on the embedded model (fp32, CPU), shared by the whole session."""
    from ngrammar import LLM

    return LLM(device="cpu", dtype="float32", kv_cache_tokens=16384)


@pytest.fixture(scope="session")
def spec_llm():  # type: ignore[no-untyped-def]
    """The same model with NGRAM speculation, non-adaptive so every decode step is a tree verify."""
    from ngrammar import LLM

    return LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
    )


@pytest.fixture(scope="session")
def hf_model(checkpoint: Checkpoint):  # type: ignore[no-untyped-def]
    """transformers' LlamaForCausalLM loaded from the same GGUF (the reference implementation)."""
    import torch
    from transformers import LlamaForCausalLM

    from ngrammar.model.loader import embedded_model_path

    path = embedded_model_path()
    model = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()
