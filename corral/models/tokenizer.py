"""The tokenizer, built offline from a GGUF file's vocabulary or from an HF folder's ``tokenizer.json``.

Byte-level BPE GGUF vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt as a HF ``tokenizers`` BPE
with the ByteLevel pre-tokenizer. SentencePiece GGUF vocabularies are not rebuilt here (give an HF folder for
those). The chat template is rendered with jinja2 the way transformers renders it.
"""

import functools
import json
import os
from dataclasses import dataclass
from typing import Literal

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from corral.errors import ModelNotFoundError
from corral.models.config import gguf_end_ids
from corral.models.files import ModelFiles, resolve_model
from corral.models.gguf_file import gguf_metadata

VocabKind = Literal["byte_level", "sentencepiece"]

# GGUF token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED, 6 = BYTE.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """Encode/decode plus what the grammar layer needs: the raw vocabulary pieces and the special ids."""

    backend: Backend
    pieces: tuple[str, ...]  # the vocabulary's own strings, id order (Ġ-mapped for byte-level BPE)
    kind: VocabKind
    special_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own chat template (a ChatML fallback when it has none)."""
        template = _compile_template(self.chat_template or _CHATML)
        eos = self.pieces[self.eos_token_ids[0]]
        bos = self.pieces[self.bos_token_id] if self.bos_token_id is not None else ""
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               eos_token=eos, bos_token=bos)


_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _raise(message):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source)


# llama.cpp's names for the pre-tokenizers that split as Llama 3's (numbers in runs of up to three digits; a word
# that is a whole vocabulary entry taken as it is, merges or not) and as Qwen2's (digit by digit)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2", "stablelm2")


def _byte_level_backend(pieces: list[str], merges: list[str], pre: str | None) -> Backend:
    vocab = {piece: i for i, piece in enumerate(pieces)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM splits digits one by one before the GPT-2 split, as its tokenizer.json does
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        digits = r"\p{N}" if pre in _QWEN2_PRE else r"\p{N}{1,3}"
        split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits +
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _from_gguf(path: str) -> Tokenizer:
    meta = gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelNotFoundError(f"{path}: GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported; "
                                 "byte-level BPE ('gpt2') is, or give a Hugging Face folder with tokenizer.json")
    pieces = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    special = {i for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)} if types is not None else set()
    backend = _byte_level_backend(pieces, meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre"))
    backend.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in sorted(special)])
    return Tokenizer(backend, tuple(pieces), "byte_level", frozenset(special), gguf_end_ids(meta),
                     meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.chat_template"))


def _token_id(backend: Backend, token) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _from_hf(folder: str) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{folder} has no tokenizer.json")
    backend = Backend.from_file(path)
    spec = json.loads(backend.to_str())
    config = {}
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces = [backend.id_to_token(i) or "" for i in range(size)]
    special = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
    model = spec["model"]
    kind: VocabKind = "sentencepiece" if model.get("byte_fallback") or "▁" in "".join(pieces[:2000]) else "byte_level"
    eos_ids = _hf_eos_ids(folder, backend, config)
    return Tokenizer(backend, tuple(pieces), kind, special, eos_ids, _token_id(backend, config.get("bos_token")),
                     config.get("chat_template"))


def _hf_eos_ids(folder: str, backend: Backend, config: dict) -> tuple[int, ...]:
    ids = []
    eos = _token_id(backend, config.get("eos_token"))
    if eos is not None:
        ids.append(eos)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f).get("eos_token_id")
        ids += [i for i in (gen if isinstance(gen, list) else [gen]) if i is not None and i not in ids]
    if not ids:
        raise ModelNotFoundError(f"{folder}: no eos_token in tokenizer_config.json or generation_config.json")
    return tuple(ids)


@functools.cache
def _load(files: ModelFiles) -> Tokenizer:
    return _from_gguf(files.path) if files.kind == "gguf" else _from_hf(files.path)


def load_tokenizer(model: ModelFiles | str | None = None) -> Tokenizer:
    """The tokenizer of ``model`` (None: the shipped default), cached per model."""
    return _load(model if isinstance(model, ModelFiles) else resolve_model(model))
