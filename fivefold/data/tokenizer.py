"""Byte-level BPE tokenizers, trained locally with Hugging Face `tokenizers` (GPT-2 style).

Byte-level means every byte sequence is encodable (no unknown token) and decoding round-trips the
text exactly. `<|endoftext|>` is the only special token and is registered first, so its id is 0,
matching the default `model.eos_token_id`. Training is deterministic for a given corpus, vocab size
and `tokenizers` version, which is what lets a trained tokenizer be cached by a hash of its inputs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fivefold.data.corpus import DataError, cache_dir, documents_hash

EOS_TOKEN = "<|endoftext|>"
# End-of-text spellings of common tokenizers, tried in order, so an imported tokenizer works too.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def train_tokenizer(docs, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (fewer if the corpus runs out of merges)."""
    if vocab_size < 257:
        # 256 byte symbols + eos are the floor; with fewer some bytes could not be encoded.
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least 257")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    length = len(docs) if hasattr(docs, "__len__") else None
    tokenizer.train_from_iterator(docs, trainer, length=length)
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (data.tokenizer / --tokenizer)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None


def tokenizer_sha(tokenizer: Tokenizer) -> str:
    """sha256 of the serialised tokenizer: two tokenizers with the same sha encode identically."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def vocab_size(tokenizer: Tokenizer) -> int:
    return tokenizer.get_vocab_size(with_added_tokens=True)


def eos_id(tokenizer: Tokenizer) -> int:
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(f"the tokenizer has no end-of-text token; expected one of {', '.join(EOS_CANDIDATES)}")


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write atomically, so a concurrent reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)


def get_tokenizer(data_cfg, docs: list[str], vocab_size: int) -> Tokenizer:
    """`data_cfg.tokenizer` if set; else a BPE trained on `docs`, cached by a hash of its inputs."""
    if data_cfg is not None and data_cfg.tokenizer:
        return load_tokenizer(data_cfg.tokenizer)
    key = hashlib.sha256(
        f"{documents_hash(docs)}:{vocab_size}:{tokenizers.__version__}".encode()).hexdigest()[:16]
    path = cache_dir(data_cfg) / f"tokenizer-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:
            pass  # a corrupt cache entry is retrained and overwritten
    tokenizer = train_tokenizer(docs, vocab_size)
    save_tokenizer(tokenizer, path)
    return tokenizer
