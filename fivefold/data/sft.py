"""Supervised fine-tuning data: JSONL examples -> rows of tokens whose loss counts only the answers.

Input (`data.sft`), one JSON object per line; blank lines are skipped and other keys ignored:
    {"prompt": "What is 2 + 3?\\n", "completion": "5"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}]}
Every problem is a DataError naming the file and line.

Tokens, encoded as the server encodes a request, and the targets (the tokens the loss counts):
  * prompt/completion: encode(prompt) with the tokenizer's own special tokens (e.g. a bos), then
    encode(completion), then eos. Targets: the completion's tokens and the eos.
  * chat: the conversation up to its last assistant turn, rendered with the chat template (the model's own
    from tokenizer_config.json, else fivefold.data.chat's default). Assistant turn i is the text the
    template adds between render(turns < i, add_generation_prompt=True) and render(turns <= i); each such
    span is encoded apart from the text around it, so the split is exact and the tokens before a reply are
    the ones the server feeds. Targets: every assistant span (with whatever end-of-turn text the template
    puts in it), plus one eos at the end of the conversation. One eos only: with model.document_mask an eos
    starts a new document, so an eos after every turn would hide the earlier turns from the later ones.
  An example's first token is never a target: nothing in the example precedes it.

Rows of train.seq_len + 1 tokens; inputs are row[:-1], labels row[1:] with IGNORE_INDEX where the label is
not a target:
  * pack: the examples in a random order seeded by train.seed (the same on every rank, whatever the
    layout) each go into the first row with room for them (first fit); the rest of a row is eos padding. With
    model.document_mask no example attends to another, and RoPE is relative, so an example's loss is the
    same packed as alone in a row (tested).
  * pad: one example per row.
  An example longer than a row keeps its first seq_len + 1 tokens: the instruction stays whole and the
  answer's tail (and its eos) is cut; it fills its row alone. One warning says how many were cut; one
  left without any target token is dropped; if every example was cut it is a DataError.

Split: an example is held out by a hash of its content (corpus.is_validation with data.val_fraction), so
the split does not depend on line order; at least one example is held out. The rows are cached under the
data cache directory as one .npz keyed by the file's sha256, the tokenizer, the chat template and the row
settings, written under a temporary name and renamed (ranks that start later read it).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from tokenizers import Tokenizer

from fivefold.checkpoint.kinds import model_directory
from fivefold.config import Config, ConfigError
from fivefold.data.chat import ChatTemplate, ChatTemplateError, special_tokens, tokenizer_and_template
from fivefold.data.corpus import (DataError, cache_dir, embedded_documents, is_validation, jsonl_objects,
                                  split_documents, split_score)
from fivefold.data.dataset import Datasets, cache_key, check_fits_model
from fivefold.data.labels import IGNORE_INDEX
from fivefold.data.tokenizer import eos_id, get_tokenizer, tokenizer_sha
from fivefold.data.tokenizer import vocab_size as tokenizer_vocab_size

CACHE_FORMAT = 1
DEMO_PATH = Path(__file__).with_name("sft_demo.jsonl")
FORMATS = 'expected {"prompt": str, "completion": str} or {"messages": [{"role": str, "content": str}, ...]}'
SPLITS = ("train", "val")


class SFTWarning(UserWarning):
    """Examples were cut to fit a row."""


# -- reading examples ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    where: str  # "path:line", for errors
    prompt: str = ""
    completion: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) per turn; empty for prompt/completion

    @property
    def content(self) -> str:
        """What the train/validation hash reads: the example's text, not its line number or spacing."""
        if self.messages:
            return json.dumps([list(m) for m in self.messages], ensure_ascii=False)
        return json.dumps([self.prompt, self.completion], ensure_ascii=False)


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _text(value, what: str, where: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} is {_json_type(value)}, not a string")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: {what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
        raise DataError(f"{where}: {what} is not valid Unicode (lone surrogate)") from None
    return value


def _parse(obj, where: str) -> Example:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: {_json_type(obj)}, not an object; {FORMATS}")
    if "messages" in obj:
        if "prompt" in obj or "completion" in obj:
            raise DataError(f'{where}: has both "messages" and "prompt"/"completion"; give one format per line')
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f'{where}: "messages" must be a non-empty array of {{"role", "content"}} objects')
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f'{where}: messages[{i}] is {_json_type(m)}, not a {{"role", "content"}} object')
            for field in ("role", "content"):
                if field not in m:
                    raise DataError(f'{where}: messages[{i}] has no "{field}"')
            role = _text(m["role"], f'messages[{i}] "role"', where)
            turns.append((role, _text(m["content"], f'messages[{i}] "content"', where,
                                      allow_empty=role != "assistant")))
        if not any(role == "assistant" for role, _ in turns):
            raise DataError(f'{where}: the conversation has no "assistant" turn, so nothing in it would be '
                            f"trained on; add the reply to learn")
        return Example(where, messages=tuple(turns))
    if "prompt" not in obj and "completion" not in obj:
        raise DataError(f"{where}: no \"prompt\"/\"completion\" or \"messages\" field; {FORMATS}")
    for field in ("prompt", "completion"):
        if field not in obj:
            raise DataError(f'{where}: "{field}" is missing; {FORMATS}')
    return Example(where, _text(obj["prompt"], '"prompt"', where), _text(obj["completion"], '"completion"', where))


def read_examples(path: str | Path) -> list[Example]:
    """The examples of a JSONL file, in file order."""
    path = Path(path)
    examples = [_parse(obj, f"{path}:{lineno}") for lineno, obj in jsonl_objects(path)]
    if not examples:
        raise DataError(f"{path}: no examples; {FORMATS}, one per line")
    return examples


# -- tokens and targets -------------------------------------------------------------------------------------

def _chat_spans(example: Example, template: ChatTemplate) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_assistant_reply) pieces that join to the whole."""
    messages = [{"role": role, "content": content} for role, content in example.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages = messages[:last + 1]  # turns after the last reply would teach nothing
    try:
        full = template.render(messages, add_generation_prompt=False)
        pieces, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = template.render(messages[:i], add_generation_prompt=True)
            upto = template.render(messages[:i + 1], add_generation_prompt=False)
            if not (full.startswith(upto) and upto.startswith(before) and len(before) >= done):
                raise DataError(f"{example.where}: the chat template does not render this conversation turn by "
                                f"turn (the text before assistant turn {i} is not a prefix of the whole), so "
                                f"its reply tokens cannot be told apart; use prompt/completion examples")
            pieces += [(full[done:len(before)], False), (full[len(before):len(upto)], True)]
            done = len(upto)
    except ChatTemplateError as e:
        raise DataError(f"{example.where}: {e}") from None
    return pieces + [(full[done:], False)]


def tokenize_example(example: Example, tokenizer: Tokenizer, template: ChatTemplate,
                     eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, targets): int64 token ids ending with eos, and a bool per token, true where the loss counts it."""
    if example.messages:
        pieces = [(tokenizer.encode(text, add_special_tokens=False).ids, target)
                  for text, target in _chat_spans(example, template) if text]
    else:
        pieces = [(tokenizer.encode(example.prompt).ids, False),
                  (tokenizer.encode(example.completion, add_special_tokens=False).ids, True)]
    ids = [i for part, _ in pieces for i in part]
    targets = [target for part, target in pieces for _ in part]
    if not ids or ids[-1] != eos:  # a template may end the reply with the eos itself
        ids.append(eos)
        targets.append(True)
    targets[0] = False
    return np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool)


# -- rows -----------------------------------------------------------------------------------------------------

@dataclass
class SFTStats:
    """One split's rows: the bench compares pack against pad with these; the trainer prints them."""
    examples: int
    rows: int
    row_tokens: int  # train.seq_len + 1
    example_tokens: int  # tokens of the examples in the rows; the rest is padding
    target_tokens: int  # labels the loss counts
    truncated: int = 0  # examples cut to fit a row (kept)
    dropped: int = 0  # examples cut to no target token (not in the rows)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.example_tokens / max(1, self.rows * self.row_tokens)


def build_rows(encoded: list[tuple[np.ndarray, np.ndarray]], row_tokens: int, packing: str, eos: int,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets), both (rows, row_tokens), from examples that each fit a row: packed first-fit in a
    seeded order, or one per row; the rest of a row is eos, never a target."""
    if packing == "pack":
        # First fit: each example goes into the first row with room for it. Rows with less room than the
        # shortest example are closed, so the search stays short.
        rows: list[list[int]] = []
        room: list[int] = []
        open_rows: list[int] = []
        shortest = min(len(ids) for ids, _ in encoded)
        for i in np.random.default_rng(seed % 2**64).permutation(len(encoded)).tolist():
            n = len(encoded[i][0])
            r = next((r for r in open_rows if room[r] >= n), None)
            if r is None:
                r = len(rows)
                rows.append([])
                room.append(row_tokens)
                open_rows.append(r)
            rows[r].append(i)
            room[r] -= n
            if room[r] < shortest:
                open_rows.remove(r)
    else:
        rows = [[i] for i in range(len(encoded))]
    tokens = np.full((len(rows), row_tokens), eos, dtype=np.int32)
    targets = np.zeros((len(rows), row_tokens), dtype=bool)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            ids, target = encoded[i]
            tokens[r, start:start + len(ids)] = ids
            targets[r, start:start + len(ids)] = target
            start += len(ids)
    return tokens, targets


class SFTDataset:
    """Rows of an SFT split. `pairs(indices)` -> (inputs, labels), each (n, seq_len) int64; labels that the
    loss must not count are IGNORE_INDEX."""

    def __init__(self, tokens: np.ndarray, targets: np.ndarray, stats: SFTStats, split: str = "train"):
        self.tokens, self.targets, self.stats, self.split = tokens, targets, stats, split
        self.seq_len = tokens.shape[1] - 1
        self.summary = ""  # one line about both splits, which the trainer prints at its first step

    def __len__(self) -> int:
        return len(self.tokens)

    def pairs(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(list(indices), dtype=np.int64)
        bad = idx[(idx < 0) | (idx >= len(self))]
        if len(bad):
            raise IndexError(f"row {bad[0]} out of range for the {len(self)} rows of the {self.split} split")
        rows = torch.from_numpy(self.tokens[idx].astype(np.int64))
        keep = torch.from_numpy(self.targets[idx, 1:])
        return rows[:, :-1], torch.where(keep, rows[:, 1:], IGNORE_INDEX)


# -- which tokenizer and chat template -------------------------------------------------------------------

def sft_tokenizer(cfg: Config) -> tuple[Tokenizer, ChatTemplate, str]:
    """(tokenizer, chat template, where they come from): data.tokenizer if set, else train.init_from's (a
    Hugging Face directory or a fivefold run / checkpoint), else the BPE trained on the embedded corpus; the
    template is the one of the model directory (or the tokenizer's directory) if it has one, else ours."""
    directory = None
    if cfg.train.init_from:
        if not Path(cfg.train.init_from).exists():
            raise ConfigError(f"train.init_from={cfg.train.init_from!r} does not exist; give a Hugging Face "
                              f"model directory or a fivefold run or checkpoint directory")
        directory = model_directory(cfg.train.init_from)
    elif cfg.data.tokenizer:
        directory = Path(cfg.data.tokenizer).parent
    where = (f"data.tokenizer={cfg.data.tokenizer!r}" if cfg.data.tokenizer else
             f"train.init_from={cfg.train.init_from!r}" if cfg.train.init_from else "the embedded corpus")
    if directory is not None:
        tokenizer, source = tokenizer_and_template(directory, cfg.data.tokenizer or None)
        if tokenizer is None:
            raise ConfigError(f"{where} has no tokenizer.json ({directory}); set data.tokenizer to the "
                              f"model's tokenizer.json")
        bos_text, eos_text = special_tokens(directory)
    else:  # the tokenizer `fivefold train` trains on the embedded corpus, found in the same cache
        if cfg.model.vocab_size < 257:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small to train a byte-level BPE "
                              f"on the embedded corpus; use at least 257, or set data.tokenizer")
        train_docs, _ = split_documents(embedded_documents(cache_dir(cfg.data)), cfg.data.val_fraction)
        tokenizer = get_tokenizer(cfg.data, train_docs, cfg.model.vocab_size)
        source, bos_text, eos_text = None, "", ""
    eos_text = eos_text or tokenizer.id_to_token(eos_id(tokenizer)) or ""
    return tokenizer, ChatTemplate(source, bos_text, eos_text), where


def sft_path(value: str) -> Path:
    path = DEMO_PATH if value == "demo" else Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"data.sft={value!r}: no such file; give a JSONL file of examples, or data.sft=demo")
    return path


# -- the datasets -----------------------------------------------------------------------------------------

def split_examples(examples: list[Example], val_fraction: float) -> dict[str, list[Example]]:
    """Held out by a hash of the content; if none would be, the one whose hash is nearest the threshold."""
    if len(examples) < 2:
        raise DataError(f"{examples[0].where.rsplit(':', 1)[0]}: one example; fine-tuning needs at least two "
                        f"(one is held out for the validation loss)")
    held = [is_validation(e.content, val_fraction) for e in examples]
    if not any(held) or all(held):
        score = [split_score(e.content, 0) for e in examples]
        chosen = int(np.argmin(score)) if not any(held) else int(np.argmax(score))
        held = [h if i != chosen else not h for i, h in enumerate(held)]
    return {"train": [e for e, h in zip(examples, held) if not h], "val": [e for e, h in zip(examples, held) if h]}


def build_sft_arrays(cfg: Config, path: Path, tokenizer: Tokenizer, template: ChatTemplate) -> dict:
    """Tokenise the file and lay out both splits' rows: {split_tokens, split_targets, stats (JSON)}."""
    row_tokens, eos = cfg.train.seq_len + 1, eos_id(tokenizer)
    examples = read_examples(path)
    arrays, stats, longest, cut_total = {}, {}, 0, 0
    for split, chosen in split_examples(examples, cfg.data.val_fraction).items():
        encoded, truncated, dropped = [], 0, 0
        for example in chosen:
            ids, targets = tokenize_example(example, tokenizer, template, eos)
            if cfg.model.document_mask and (ids[:-1] == eos).any():
                raise DataError(f"{example.where}: the end-of-text token appears inside the example (in its text "
                                f"or from the chat template); with model.document_mask=true it would start a new "
                                f"document mid-example. Remove it, or set model.document_mask=false with "
                                f"data.sft_packing=pad")
            longest = max(longest, len(ids))
            if len(ids) > row_tokens:
                ids, targets = ids[:row_tokens], targets[:row_tokens]
                truncated += 1
                if not targets.any():
                    dropped += 1
                    continue
            encoded.append((ids, targets))
        cut_total += truncated
        if not encoded:
            what = "all its examples" if split == "train" else "its held-out examples"
            raise DataError(f"{path}: {what} are longer than train.seq_len + 1 = {row_tokens} tokens (the longest "
                            f"has {longest}) and lost every answer token to truncation; raise train.seq_len")
        tokens, targets = build_rows(encoded, row_tokens, cfg.data.sft_packing, eos, cfg.train.seed)
        arrays[f"{split}_tokens"], arrays[f"{split}_targets"] = tokens, targets
        stats[split] = asdict(SFTStats(len(encoded), len(tokens), row_tokens, sum(len(e[0]) for e in encoded),
                                       int(targets.sum()), truncated, dropped))
    if cut_total == len(examples):
        raise DataError(f"{path}: all {len(examples)} examples are longer than train.seq_len + 1 = {row_tokens} "
                        f"tokens (the longest has {longest}); raise train.seq_len")
    if cut_total:
        dropped = stats["train"]["dropped"] + stats["val"]["dropped"]
        lost = f"; {dropped} lost every answer token and were dropped" if dropped else ""
        warnings.warn(f"{path}: {cut_total} of {len(examples)} examples are longer than train.seq_len + 1 = "
                      f"{row_tokens} tokens and were cut to fit (their ends dropped){lost}; the longest has "
                      f"{longest} tokens: raise train.seq_len to keep them whole", SFTWarning, stacklevel=2)
    arrays["stats"] = np.array(json.dumps(stats))
    return arrays


def _read_cache(path: Path) -> dict | None:
    try:
        with np.load(path, allow_pickle=False) as blob:
            return {name: blob[name] for name in blob.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # absent or damaged: rebuilt


def _write_cache(path: Path, arrays: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # concurrent writers write identical bytes; the last rename wins


def describe(name: str, packing: str, stats: dict[str, SFTStats]) -> str:
    """One line: the examples, rows, target tokens, padding and truncation of both splits."""
    train, val = stats["train"], stats["val"]
    cut = train.truncated + val.truncated
    return (f"sft data {name}: {train.examples:,} train / {val.examples:,} val examples in {train.rows:,} / "
            f"{val.rows:,} rows of {train.row_tokens} tokens ({packing}) | {train.target_tokens:,} train target "
            f"tokens | padding {train.padding_fraction:.1%} | {cut} truncated")


def load_sft_datasets(cfg: Config) -> Datasets:
    """The SFT rows of `cfg.data.sft` for training and validation, tokenised once and cached."""
    path = sft_path(cfg.data.sft)
    tokenizer, template, where = sft_tokenizer(cfg)
    eos = eos_id(tokenizer)
    check_fits_model(cfg, tokenizer_vocab_size(tokenizer), eos, where)
    key = cache_key({"format": CACHE_FORMAT, "file": hashlib.sha256(path.read_bytes()).hexdigest(),
                "tokenizer": tokenizer_sha(tokenizer), "template": template.source, "bos": template.bos_token,
                "eos": template.eos_token, "row_tokens": cfg.train.seq_len + 1, "packing": cfg.data.sft_packing,
                "val_fraction": cfg.data.val_fraction, "seed": cfg.train.seed,
                "document_mask": cfg.model.document_mask})[:16]
    cache = cache_dir(cfg.data) / f"sft-{key}.npz"
    arrays = _read_cache(cache)
    if arrays is None:
        arrays = build_sft_arrays(cfg, path, tokenizer, template)
        _write_cache(cache, arrays)
    stats = {split: SFTStats(**s) for split, s in json.loads(str(arrays["stats"])).items()}
    name = "demo" if cfg.data.sft == "demo" else str(path)
    train, val = (SFTDataset(arrays[f"{s}_tokens"], arrays[f"{s}_targets"], stats[s], s) for s in SPLITS)
    train.summary = describe(name, cfg.data.sft_packing, stats)
    return Datasets(train=train, val=val, tokenizer=tokenizer, eos_id=eos, data_dir=path.parent)
