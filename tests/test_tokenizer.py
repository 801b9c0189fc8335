"""Text and logprob rendering with a Llama-2 / Mistral-style SentencePiece tokenizer.

The embedded SmolLM2 uses byte-level BPE; this module builds a BPE tokenizer with byte fallback
(``<0xE2>`` tokens), a Metaspace pre-tokenizer ("▁" for spaces) and the decoder whose Strip step
removes the leading space of the first token decoded, trained locally in a few milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ngrammar.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ngrammar.outputs import TokenLogprob

CORPUS = ["The model loads the weights.", "Hello world, the cost is 5 euros.", "café naïve déjà vu"] * 20


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    folder: Path = tmp_path_factory.mktemp("sp")
    trained = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False),
    )
    spec = json.loads(trained.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get):
        vocab.setdefault(token, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return Tokenizer(folder, (2,))


def test_a_completion_keeps_the_leading_space_of_its_first_token(sp_tokenizer: Tokenizer) -> None:
    """Regression: the output was decoded without prompt context, so the Strip decoder ate the
    first token's space: "The model" + " loads" came out "The modelloads" (and a grammar's
    " [a-z]+" output did not match its own text)."""
    prompt = sp_tokenizer.encode("The model")
    ids = prompt + sp_tokenizer.encode(" loads the weights €")
    assert sp_tokenizer.hf.convert_ids_to_tokens(ids[len(prompt)]).startswith("▁")
    assert sp_tokenizer.decode(ids[len(prompt) :]) == "loads the weights €"  # decoded alone: no space
    detok = IncrementalDetokenizer.after_prompt(sp_tokenizer, len(prompt))
    deltas = [detok.step(ids[:k]) for k in range(len(prompt) + 1, len(ids) + 1)]
    assert "".join(deltas) == detok.text == " loads the weights €"
    assert sp_tokenizer.decode(prompt) + detok.text == sp_tokenizer.decode(ids)


def test_logprob_bytes_and_offsets_follow_the_text(sp_tokenizer: Tokenizer) -> None:
    """The logprob tokens' bytes join to the completion's text, offsets point into it, and of two
    tokens with one text (byte fallback's "e" and <0x65>) the best-ranked one keeps its logprob."""
    from ngrammar.server.rendering import TextOffsets, chat_logprobs, completion_logprobs

    prompt = sp_tokenizer.encode("The model")
    out = sp_tokenizer.encode(" loads € now")
    detok = IncrementalDetokenizer.after_prompt(sp_tokenizer, len(prompt))
    detok.step(prompt + out)
    lps = [TokenLogprob(t, -0.25) for t in out]
    assert (
        bytes(b for c in chat_logprobs(sp_tokenizer, lps).content for b in c.bytes or []).decode()
        == detok.text
    )
    legacy = completion_logprobs(sp_tokenizer, lps, TextOffsets())
    expected = [
        len(sp_tokenizer.decode(prompt + out[:k]).rstrip("\ufffd")) - len(sp_tokenizer.decode(prompt))
        for k in range(len(out))
    ]
    assert legacy.text_offset == expected
    e, byte_e = sp_tokenizer.hf.convert_tokens_to_ids(["e", "<0x65>"])
    top = completion_logprobs(
        sp_tokenizer, [TokenLogprob(e, -0.245, ((e, -0.245), (byte_e, -1.5)))], TextOffsets()
    ).top_logprobs[0]
    assert top == {"e": -0.245}
