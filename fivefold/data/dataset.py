"""Token shards on disk, packed training windows, and a resumable sampler.

A prepared dataset directory (written by `prepare`, read by `TokenStore`):
    index.json        dtype, vocab size, eos id, tokenizer sha, shards and counts per split
    tokenizer.json    the tokenizer the shards were encoded with
    train_000.bin ... raw little-endian uint16 (uint32 when the vocab does not fit) token ids
    val_000.bin ...   each document is followed by the eos token, so documents stay delimited

Documents go to the validation split by a hash of their text (`corpus.is_validation`), so the split
does not depend on file order. The directory is written under a temporary name and renamed into
place, so it is either absent or complete; `index.json` records a key of the inputs (paths, sizes,
mtimes, tokenizer sha, split settings), and a second `prepare` with the same key returns at once.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from tokenizers import Tokenizer

from fivefold.config import Config, ConfigError
from fivefold.data.corpus import (DataError, cache_dir, documents_hash, embedded_documents, expand_inputs,
                                  is_validation, iter_documents, split_documents)
from fivefold.data.tokenizer import eos_id, get_tokenizer, load_tokenizer, tokenizer_sha, train_tokenizer
from fivefold.data.tokenizer import vocab_size as tokenizer_vocab_size

INDEX_FORMAT = 1
SHARD_TOKENS = 64 * 2**20  # 128 MiB per uint16 shard: large files, but few enough to memmap cheaply
SPLITS = ("train", "val")
_ENCODE_BATCH_CHARS = 8 * 2**20  # bound the text held in memory while encoding


def read_index(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "index.json"
    if not path.is_file():
        raise DataError(f"{data_dir}: no index.json; run `fivefold prepare --input FILES --out {data_dir}` first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def _is_current(out_dir: Path, key: str) -> dict | None:
    """The index of `out_dir` if it was prepared from the same inputs and its shards are intact."""
    try:
        index = read_index(out_dir)
    except DataError:
        return None
    if index.get("key") != key or index.get("format") != INDEX_FORMAT:
        return None
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in index["splits"].values():
        for shard in split["shards"]:
            path = out_dir / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
                return None
    return index


class _ShardWriter:
    """Appends token arrays to `<split>_000.bin`, `<split>_001.bin`, ... of at most `shard_tokens`."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self.max_token_id = -1  # recorded in index.json: a dataset is checked against the model's vocabulary
        self._file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def append(self, ids: np.ndarray) -> None:
        if len(ids):
            self.max_token_id = max(self.max_token_id, int(ids.max()))
        while len(ids):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):03d}.bin"
                self._file = open(self.out_dir / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
            room = self.shard_tokens - self.shards[-1]["tokens"]
            chunk, ids = ids[:room], ids[room:]
            self._file.write(chunk.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self.shards[-1]["tokens"] += len(chunk)
            if self.shards[-1]["tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _publish(tmp: Path, out_dir: Path, key: str) -> None:
    """Rename the finished `tmp` to `out_dir`, replacing an older preparation of it."""
    old = None
    if out_dir.exists():
        if _is_current(out_dir, key):  # a concurrent process (another rank) got there first
            shutil.rmtree(tmp)
            return
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not _is_current(out_dir, key):
            raise
        shutil.rmtree(tmp)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_prepared(documents: Iterable[tuple[str, str]], out_dir: Path, tokenizer: Tokenizer, key: str,
                    meta: dict, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Encode (text, split) pairs into shards under a temporary directory, then publish it."""
    vocab, eos = tokenizer_vocab_size(tokenizer), eos_id(tokenizer)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    # A document that happens to contain the literal text "<|endoftext|>" must not end early, so
    # special tokens inside documents are encoded as plain text; eos is only added between documents.
    encoder = Tokenizer.from_str(tokenizer.to_str())
    encoder.encode_special_tokens = True

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers = {split: _ShardWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
    eos_array = np.array([eos], dtype=np.int64)

    def flush(batch: list[tuple[str, str]]) -> None:
        encodings = encoder.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
        for (_, split), enc in zip(batch, encodings):
            writers[split].append(np.concatenate([np.asarray(enc.ids, dtype=np.int64), eos_array]))
            writers[split].documents += 1

    try:
        batch, chars = [], 0
        for text, split in documents:
            if not text:
                continue  # an empty document would only add a stray eos
            batch.append((text, split))
            chars += len(text)
            if chars >= _ENCODE_BATCH_CHARS or len(batch) >= 4096:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
        for writer in writers.values():
            writer.close()
        if writers["train"].tokens == 0:
            what = "all documents fell into the validation split" if writers["val"].tokens else "no text"
            raise DataError(f"{meta.get('source', out_dir)}: empty corpus ({what}); nothing to train on")
        index = {
            "format": INDEX_FORMAT, "key": key, "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos,
            "tokenizer_sha256": tokenizer_sha(tokenizer), "shard_tokens": shard_tokens, **meta,
            "splits": {split: {"tokens": w.tokens, "documents": w.documents, "shards": w.shards,
                               "max_token_id": w.max_token_id} for split, w in writers.items()},
        }
        tokenizer.save(str(tmp / "tokenizer.json"))
        with open(tmp / "index.json", "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, out_dir, key)
    except BaseException:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _check_out_dir(out_dir: Path) -> None:
    # Never replace a directory that `prepare` did not write: --out may be a typo for a real folder.
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir())
                                                      and not (out_dir / "index.json").is_file())):
        raise DataError(f"{out_dir}: exists and is not a prepared dataset (no index.json); "
                        f"choose another --out or remove it")


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def prepare_documents(train_docs: list[str], val_docs: list[str], out_dir: str | Path, tokenizer: Tokenizer,
                      shard_tokens: int = SHARD_TOKENS) -> dict:
    """Write already-split documents as a prepared dataset (idempotent: same inputs, same directory)."""
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    key = cache_key({"format": INDEX_FORMAT, "train": documents_hash(train_docs), "val": documents_hash(val_docs),
                "tokenizer": tokenizer_sha(tokenizer), "shard_tokens": shard_tokens})
    index = _is_current(out_dir, key)
    if index is None:
        pairs = [(d, "train") for d in train_docs] + [(d, "val") for d in val_docs]
        index = _write_prepared(pairs, out_dir, tokenizer, key, {"source": "documents"}, shard_tokens)
        return {**index, "reused": False}
    return {**index, "reused": True}


def prepare(inputs: list[str | Path], out_dir: str | Path, tokenizer: Tokenizer | str | Path | None = None,
            val_fraction: float = 0.05, seed: int = 0, vocab_size: int = 4096,
            shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenise .txt/.md (one document per file), .jsonl (one per line, field "text") and .parquet
    (column "text") files, or directories of them, into token shards under `out_dir`.

    `tokenizer` is a Tokenizer or a tokenizer.json path; None trains a byte-level BPE with
    `vocab_size` entries on the training split of the inputs. `seed` salts the train/val hash.
    Returns the index (see the module docstring) plus "reused": True when nothing needed doing.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
    out_dir = Path(out_dir)
    files = expand_inputs(inputs)
    _check_out_dir(out_dir)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    stats = [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    # A trained tokenizer is a deterministic function of the inputs, so its recipe can stand in for
    # its sha; that lets a repeated prepare return before spending time on training.
    recipe = tokenizer_sha(tokenizer) if tokenizer is not None else f"bpe:{vocab_size}"
    key = cache_key({"format": INDEX_FORMAT, "inputs": stats, "tokenizer": recipe, "val_fraction": val_fraction,
                "seed": seed, "shard_tokens": shard_tokens})
    index = _is_current(out_dir, key)
    if index is not None:
        return {**index, "reused": True}
    if tokenizer is None:
        # The tokenizer never sees validation text, so the validation loss stays a held-out number.
        train_texts = (t for t in iter_documents(files) if not is_validation(t, val_fraction, seed))
        tokenizer = train_tokenizer(train_texts, vocab_size)
    pairs = ((t, "val" if is_validation(t, val_fraction, seed) else "train") for t in iter_documents(files))
    meta = {"source": ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else ""),
            "inputs": stats, "val_fraction": val_fraction, "seed": seed}
    return {**_write_prepared(pairs, out_dir, tokenizer, key, meta, shard_tokens), "reused": False}


class TokenStore:
    """The shards of one split as read-only memmaps, addressed as one contiguous token array."""

    def __init__(self, data_dir: str | Path, split: str):
        self.data_dir, self.split = Path(data_dir), split
        index = read_index(self.data_dir)
        if split not in index["splits"]:
            raise DataError(f"{self.data_dir}: no split {split!r}; it has {', '.join(index['splits'])}")
        self.dtype = np.dtype(index["dtype"])
        self._shards: list[np.memmap] = []
        self._starts = [0]  # token offset of each shard; the last entry is the total
        for shard in index["splits"][split]["shards"]:
            path = self.data_dir / shard["file"]
            expected = shard["tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise DataError(f"{path}: missing or truncated (expected {expected} bytes); "
                                f"run `fivefold prepare` again")
            self._shards.append(np.memmap(path, dtype=self.dtype.newbyteorder("<"), mode="r",
                                          shape=(shard["tokens"],)))
            self._starts.append(self._starts[-1] + shard["tokens"])

    @property
    def num_tokens(self) -> int:
        return self._starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as a fresh array, crossing shard boundaries as needed."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the {self.split} split "
                             f"of {self.num_tokens} tokens")
        k = bisect.bisect_right(self._starts, start) - 1
        parts = []
        while length > 0:
            offset = start - self._starts[k]
            n = min(length, len(self._shards[k]) - offset)
            parts.append(self._shards[k][offset:offset + n])
            start, length, k = start + n, length - n, k + 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)


class PackedSequences:
    """Non-overlapping windows of seq_len + 1 tokens: item i covers tokens [i*seq_len, (i+1)*seq_len].
    Consecutive windows share their boundary token (the last label of one is the first input of the
    next), so every token after the first is predicted exactly once per epoch."""

    def __init__(self, store: TokenStore, seq_len: int, vocab_size: int | None = None):
        n = store.num_tokens
        if n < seq_len + 1:
            fix = f"set train.seq_len to at most {n - 1}" if n >= 2 else "add more text"
            raise ConfigError(f"the {store.split} split of {store.data_dir} has {n} tokens, fewer than "
                              f"train.seq_len + 1 = {seq_len + 1}; {fix} (or prepare more data)")
        self.store, self.seq_len, self.vocab_size = store, seq_len, vocab_size

    def __len__(self) -> int:
        return (self.store.num_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batch([i])[0]

    def pairs(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (n, seq_len) int64: every token of a window counts (the trainer's view of
        any dataset; fine-tuning data sets the labels it does not count to IGNORE_INDEX)."""
        batch = self.batch(indices)
        return batch[:, :-1], batch[:, 1:]

    def batch(self, indices: Iterable[int]) -> torch.Tensor:
        """(n, seq_len + 1) int64; inputs are [:, :-1] and labels [:, 1:]."""
        rows, indices = [], list(indices)
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"window {i} out of range for {len(self)} windows")
            rows.append(self.store.read(i * self.seq_len, self.seq_len + 1))
        if not rows:
            return torch.empty(0, self.seq_len + 1, dtype=torch.long)
        batch = np.stack(rows).astype(np.int64)
        if self.vocab_size is not None and batch.max() >= self.vocab_size:  # a damaged or foreign shard
            row, col = np.unravel_index(int(batch.argmax()), batch.shape)
            position = indices[row] * self.seq_len + col
            raise DataError(f"{self.store.data_dir}: token id {int(batch.max())} at token {position} of the "
                            f"{self.store.split} split is not below model.vocab_size={self.vocab_size}; the shards "
                            f"are damaged or were not written for this index.json: run `fivefold prepare` again")
        return torch.from_numpy(batch)


class ResumableSampler:
    """An endless, deterministic stream of item indices: epoch e is a permutation drawn from
    np.random.default_rng([seed, e]). Its state is two ints, so a checkpoint resumes it exactly,
    and the stream does not depend on how it is taken (take(8) twice == take(16))."""

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError(f"num_items={num_items} must be at least 1")
        self.num_items, self.seed = num_items, seed
        self.epoch, self.position = 0, 0
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            rng = np.random.default_rng([self.seed % 2**64, self.epoch])
            self._perm = (self.epoch, rng.permutation(self.num_items))
        return self._perm[1]

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            k = min(n - len(out), self.num_items - self.position)
            out.extend(self._permutation()[self.position:self.position + k].tolist())
            self.position += k
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_items:
            raise ValueError(f"sampler state {state} does not fit {self.num_items} items; was the dataset "
                             f"prepared again, with other data, after the checkpoint was made? Resume on the data "
                             f"the run started with")
        self.epoch, self.position = epoch, position


@dataclass
class Datasets:
    train: PackedSequences
    val: PackedSequences
    tokenizer: Tokenizer
    eos_id: int
    data_dir: Path


def check_fits_model(cfg: Config, vocab: int, eos: int, where: str) -> None:
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the "
                          f"tokenizer of {where}; set model.vocab_size={vocab} or larger")
    if eos != cfg.model.eos_token_id:
        raise ConfigError(f"model.eos_token_id={cfg.model.eos_token_id} but the end-of-text id of the tokenizer "
                          f"of {where} is {eos}; set model.eos_token_id={eos}")


def _prepare_embedded(cfg: Config) -> Path:
    if not cfg.data.tokenizer and cfg.model.vocab_size < 257:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small to train a byte-level BPE "
                          f"on the embedded corpus; use at least 257 (e.g. 4096)")
    cache = cache_dir(cfg.data)
    docs = embedded_documents(cache)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction)
    tokenizer = get_tokenizer(cfg.data, train_docs, cfg.model.vocab_size)
    check_fits_model(cfg, tokenizer_vocab_size(tokenizer), eos_id(tokenizer), "the embedded corpus")
    key = cache_key({"docs": documents_hash(docs), "val_fraction": cfg.data.val_fraction,
                "tokenizer": tokenizer_sha(tokenizer)})[:16]
    out_dir = cache / f"embedded-{key}"
    prepare_documents(train_docs, val_docs, out_dir, tokenizer)
    return out_dir


def load_pretraining_datasets(cfg: Config) -> Datasets:
    """The train and validation windows for `cfg`: the embedded corpus, or a `prepare`d directory."""
    if cfg.data.dataset == "embedded":
        data_dir = _prepare_embedded(cfg)
    else:
        data_dir = Path(cfg.data.dataset).expanduser()
        if not (data_dir / "index.json").is_file():
            raise ConfigError(f"data.dataset={cfg.data.dataset!r} is not a prepared dataset (no index.json); "
                              f"run `fivefold prepare --input ... --out {cfg.data.dataset}` first")
    index = read_index(data_dir)
    tokenizer = load_tokenizer(data_dir / "tokenizer.json")
    if cfg.data.tokenizer and tokenizer_sha(load_tokenizer(cfg.data.tokenizer)) != index["tokenizer_sha256"]:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} differs from the tokenizer {data_dir} was "
                          f"prepared with; unset data.tokenizer or prepare the data with it")
    check_fits_model(cfg, index["vocab_size"], index["eos_id"], str(data_dir))
    vocab = cfg.model.vocab_size
    for split in SPLITS:
        largest = index["splits"].get(split, {}).get("max_token_id", -1)
        if largest >= vocab:
            raise DataError(f"{data_dir}: the {split} split holds token id {largest}, but model.vocab_size={vocab}; "
                            f"set model.vocab_size={largest + 1} or larger, or prepare the data with this "
                            f"model's tokenizer")
    seq_len = cfg.train.seq_len
    return Datasets(train=PackedSequences(TokenStore(data_dir, "train"), seq_len, vocab),
                    val=PackedSequences(TokenStore(data_dir, "val"), seq_len, vocab),
                    tokenizer=tokenizer, eos_id=index["eos_id"], data_dir=data_dir)
