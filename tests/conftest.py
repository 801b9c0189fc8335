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
    """transformers' LlamaForCausalLM loaded from the same GGUF (the reference implementation).

    transformers parses the GGUF twice (config, then weights) and rebuilds gguf's tensor-name map
    for every module (~400 times); both are pure functions of their arguments, cached here for the
    load only (12 s -> 5 s on the 2-core box), so the weights and config are transformers' own."""
    import functools

    import gguf
    import torch
    from transformers import LlamaForCausalLM

    from ngrammar.model.loader import embedded_model_path

    path = embedded_model_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = LlamaForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        )
    return model.eval()
