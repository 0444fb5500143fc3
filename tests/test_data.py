"""The data pipeline: embedded corpus, BPE tokenizer, token shards, packed windows, sampler, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.cli import main
from fivefold.config import Config, ConfigError
from fivefold.data import corpus
from fivefold.data.dataset import DataError, PackedSequences, ResumableSampler, TokenStore, prepare, prepare_documents
from fivefold.data.load import load_datasets
from fivefold.data.tokenizer import eos_id, get_tokenizer, load_tokenizer, tokenizer_sha, train_tokenizer

WORDS = ("the model reads tokens from shards and each window predicts the next token while a sampler "
         "walks one permutation per epoch so that resuming from a checkpoint replays nothing").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + f". Doc {i}." for i in range(n)]


def n_tokens(tokenizer, docs) -> int:
    """The reference count: encoded lengths plus one eos per document."""
    return sum(len(tokenizer.encode(d).ids) + 1 for d in docs)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fivefold-cache")


@pytest.fixture(scope="session")
def embedded(session_cache) -> list[str]:
    return corpus.embedded_documents(session_cache)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(make_docs(300, seed=1), 320)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------- corpus


def test_embedded_corpus_is_large_cached_and_ordered(embedded, session_cache):
    assert len(embedded) > 300 and sum(map(len, embedded)) > 1_000_000
    assert all(isinstance(d, str) and d for d in embedded)
    assert "assert" in embedded[0]  # pydoc topics come first, sorted by name
    assert corpus.embedded_documents(session_cache) == embedded  # the JSON cache round-trips
    assert list(session_cache.glob("corpus-python-*.json"))
    sources = corpus.stdlib_sources()
    assert sources == corpus.stdlib_sources() and sources
    assert not any({"test", "tests", "idlelib", "site-packages"} & set(p.parts) for p in sources)


def test_split_is_disjoint_order_independent_and_near_fraction(embedded):
    train, val = corpus.split_documents(embedded, 0.2)
    assert len(train) + len(val) == len(embedded)
    assert not set(train) & set(val)
    assert abs(len(val) / len(embedded) - 0.2) < 0.06
    train_r, val_r = corpus.split_documents(embedded[::-1], 0.2)
    assert set(val_r) == set(val) and val_r == val[::-1]


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_eos_is_zero(tok):
    text = "Héllo,  wörld!\n\tindented 😀 <tag> 1234"
    assert tok.decode(tok.encode(text).ids) == text
    assert eos_id(tok) == 0 and tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() == 320


def test_tokenizer_training_is_deterministic_and_cached(tmp_path):
    docs = make_docs(200, seed=2)
    assert tokenizer_sha(train_tokenizer(docs, 300)) == tokenizer_sha(train_tokenizer(docs, 300))
    cfg = Config().data
    cfg.cache_dir = str(tmp_path / "c")
    first = get_tokenizer(cfg, docs, 300)
    cached = list((tmp_path / "c").glob("tokenizer-*.json"))
    assert len(cached) == 1
    assert tokenizer_sha(get_tokenizer(cfg, docs, 300)) == tokenizer_sha(first)
    cfg.tokenizer = str(cached[0])
    assert tokenizer_sha(get_tokenizer(cfg, [], 300)) == tokenizer_sha(first)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------- prepare


def write_inputs(root: Path) -> list[str]:
    """Two .txt files, a .md file, a .jsonl file and a .parquet file; returns all documents."""
    docs = make_docs(40, seed=3)
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(docs[0], encoding="utf-8")
    (root / "b.md").write_text(docs[1], encoding="utf-8")
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[2:25]))
                                  + "\n", encoding="utf-8")  # a trailing blank line is skipped
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs[25:], "n": list(range(15))}), root / "d.parquet")
    return docs


def read_bin(data_dir: Path, split: str) -> np.ndarray:
    index = json.loads((data_dir / "index.json").read_text())
    parts = [np.fromfile(data_dir / s["file"], dtype=np.uint16) for s in index["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.empty(0, np.uint16)


def test_prepare_writes_every_token_once(tmp_path, tok):
    docs = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    index = prepare([tmp_path / "in"], out, tok, val_fraction=0.2, shard_tokens=100)
    val_docs = [d for d in docs if corpus.is_validation(d, 0.2)]
    train_docs = [d for d in docs if not corpus.is_validation(d, 0.2)]
    assert index["dtype"] == "uint16" and index["eos_id"] == 0 and not index["reused"]
    assert index["splits"]["train"]["documents"] == len(train_docs) and len(val_docs) > 0
    assert index["splits"]["val"]["documents"] == len(val_docs)
    assert index["splits"]["train"]["tokens"] == n_tokens(tok, train_docs)
    assert index["splits"]["val"]["tokens"] == n_tokens(tok, val_docs)
    assert len(index["splits"]["train"]["shards"]) == -(-n_tokens(tok, train_docs) // 100)
    # Files are read in sorted order, so the train shards hold the train documents in input order.
    expected = np.concatenate([tok.encode(d).ids + [0] for d in train_docs])
    np.testing.assert_array_equal(read_bin(out, "train"), expected)
    assert tokenizer_sha(load_tokenizer(out / "tokenizer.json")) == tokenizer_sha(tok)
    store = TokenStore(out, "train")
    assert store.num_tokens == len(expected)
    np.testing.assert_array_equal(store.read(95, 30), expected[95:125])  # crosses a shard boundary
    with pytest.raises(IndexError):
        store.read(len(expected) - 1, 2)


def test_prepare_is_idempotent_and_notices_changes(tmp_path, tok):
    write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prepare([tmp_path / "in"], out, tok, val_fraction=0.2)
    mtime = (out / "index.json").stat().st_mtime_ns
    again = prepare([tmp_path / "in"], out, tok, val_fraction=0.2)
    assert again["reused"] and (out / "index.json").stat().st_mtime_ns == mtime
    (tmp_path / "in" / "a.txt").write_text("a different first document, somewhat longer than before")
    changed = prepare([tmp_path / "in"], out, tok, val_fraction=0.2)
    assert not changed["reused"]
    assert not list(tmp_path.glob(".out.*"))  # no temporary or old directories left behind


def test_special_token_text_inside_a_document_is_not_eos(tmp_path, tok):
    (tmp_path / "a.txt").write_text("before <|endoftext|> after")
    index = prepare([tmp_path / "a.txt"], tmp_path / "out", tok, val_fraction=0.01)
    tokens = read_bin(tmp_path / "out", "train")
    assert index["splits"]["train"]["documents"] == 1 and list(tokens).count(0) == 1 and tokens[-1] == 0


@pytest.mark.parametrize("case, name, message", [
    ("missing", "nope.txt", "no such file"),
    ("empty_dir", "emptydir", "no .txt"),
    ("nul", "bin.txt", r"not UTF-8 text \(byte 0x00 at offset 5\)"),
    ("latin1", "latin.txt", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("bad_json", "bad.jsonl", r"bad.jsonl:2: not valid JSON"),
    ("no_text", "notext.jsonl", r'notext.jsonl:3: expected a JSON object with a string "text"'),
    ("bad_utf8_jsonl", "enc.jsonl", r"enc.jsonl:2: not UTF-8 text \(byte 0xff at offset 25\)"),
    ("empty", "empty.txt", "empty corpus"),
    ("suffix", "data.csv", "unsupported file type"),
    ("parquet_column", "t.parquet", 'no "text" column'),
    ("not_parquet", "junk.parquet", "not a readable parquet file"),
])
def test_bad_input_names_the_file(tmp_path, tok, case, name, message):
    path = tmp_path / name
    if case == "empty_dir":
        path.mkdir()
        (path / "notes.csv").write_text("x")
    elif case == "nul":
        path.write_bytes(b"hello\x00world")
    elif case == "latin1":
        path.write_bytes("café au lait".encode("latin-1"))
    elif case == "bad_json":
        path.write_text('{"text": "ok"}\n{"text": oops}\n')
    elif case == "no_text":
        path.write_text('{"text": "ok"}\n\n{"body": "no text field"}\n')
    elif case == "bad_utf8_jsonl":
        path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    elif case == "empty":
        path.write_text("")
    elif case in ("suffix", "not_parquet"):
        path.write_text("a,b\n1,2\n")
    elif case == "parquet_column":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataError, match=message) as err:
        prepare([path], tmp_path / "out", tok)
    assert str(path) in str(err.value)
    assert not list(tmp_path.glob("*out*"))  # neither the output nor its temporary directory


def test_prepare_refuses_to_replace_a_foreign_directory(tmp_path, tok):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", tok)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------- windows and sampler


def test_packed_windows_are_contiguous_with_shifted_labels(tmp_path, tok):
    docs = make_docs(30, seed=4)
    prepare_documents(docs, docs[:3], tmp_path / "d", tok, shard_tokens=300)
    tokens = torch.from_numpy(read_bin(tmp_path / "d", "train").astype(np.int64))
    seq = PackedSequences(TokenStore(tmp_path / "d", "train"), seq_len=16)
    assert len(seq) == (len(tokens) - 1) // 16
    batch = seq.batch(range(len(seq)))
    assert batch.dtype == torch.long and batch.shape == (len(seq), 17)
    expected = torch.stack([tokens[i * 16:i * 16 + 17] for i in range(len(seq))])
    torch.testing.assert_close(batch, expected, rtol=0, atol=0)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    torch.testing.assert_close(labels[:, :-1], inputs[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(labels.flatten(), tokens[1:len(seq) * 16 + 1], rtol=0, atol=0)  # each once
    with pytest.raises(IndexError):
        seq.batch([len(seq)])


@pytest.mark.parametrize("tokens, windows", [(48, 2), (49, 3), (50, 3), (17, 1)])
def test_every_window_has_its_last_label(tokens, windows):
    """A window needs seq_len + 1 tokens: 48 tokens hold two windows of 16, not three (a third would end past
    the split), and 49 hold three. Every window counted can be read."""
    class ArrayStore:  # the part of TokenStore a PackedSequences reads
        split, data_dir, num_tokens = "train", "memory", tokens

        def read(self, start, length):
            assert 0 <= start and start + length <= tokens, (start, length)
            return np.arange(start, start + length)

    seq = PackedSequences(ArrayStore(), seq_len=16)
    assert len(seq) == windows
    batch = seq.batch(range(len(seq)))
    assert batch[-1, -1] == windows * 16 <= tokens - 1


def test_packed_sequences_too_short_split_names_the_fix(tmp_path, tok):
    prepare_documents(make_docs(5), ["tiny"], tmp_path / "d", tok)
    store = TokenStore(tmp_path / "d", "val")
    with pytest.raises(ConfigError, match=rf"val split .* has {store.num_tokens} tokens.*train.seq_len"):
        PackedSequences(store, seq_len=64)


def test_sampler_is_deterministic_chunking_independent_and_resumable():
    a, b = ResumableSampler(10, seed=7), ResumableSampler(10, seed=7)
    stream = a.take(35)
    assert b.take(8) + b.take(8) + b.take(19) == stream
    for epoch in range(3):
        assert sorted(stream[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert stream[:10] == np.random.default_rng([7, 0]).permutation(10).tolist()
    assert stream[:10] != stream[10:20] and ResumableSampler(10, seed=8).take(10) != stream[:10]
    c = ResumableSampler(10, seed=7)
    c.take(13)
    state = json.loads(json.dumps(c.state_dict()))
    assert state == {"epoch": 1, "position": 3}
    d = ResumableSampler(10, seed=7)
    d.load_state_dict(state)
    assert d.take(22) == stream[13:35] == c.take(22)
    with pytest.raises(ValueError, match="does not fit"):
        ResumableSampler(5, seed=7).load_state_dict({"epoch": 0, "position": 5})


# ---------------------------------------------------------------------------------- load_datasets, CLI


def test_load_datasets_from_a_prepared_directory(tmp_path, tok):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(200, seed=5)))
    prepare([tmp_path / "in.jsonl"], tmp_path / "d", tok, val_fraction=0.1)
    cfg = Config()
    cfg.data.dataset, cfg.train.seq_len, cfg.model.vocab_size = str(tmp_path / "d"), 32, 320
    ds = load_datasets(cfg)
    assert ds.eos_id == 0 and len(ds.train) > 10 and len(ds.val) > 0 and ds.data_dir == tmp_path / "d"
    assert ds.train.batch([0, 1]).shape == (2, 33)
    cfg.model.vocab_size = 300
    with pytest.raises(ConfigError, match="model.vocab_size=320"):
        load_datasets(cfg)
    cfg.model.vocab_size, cfg.model.eos_token_id = 320, 5
    with pytest.raises(ConfigError, match="model.eos_token_id=0"):
        load_datasets(cfg)
    cfg.data.dataset = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="fivefold prepare --input"):
        load_datasets(cfg)


def test_load_datasets_embedded(session_cache, embedded):
    cfg = Config()
    cfg.data.cache_dir, cfg.model.vocab_size, cfg.train.seq_len = str(session_cache), 512, 128
    ds = load_datasets(cfg)
    assert ds.tokenizer.get_vocab_size() == 512 and ds.data_dir.parent == session_cache
    train_docs, val_docs = corpus.split_documents(embedded, cfg.data.val_fraction)
    assert ds.val.store.num_tokens == n_tokens(ds.tokenizer, val_docs)
    assert ds.train.store.num_tokens > 600_000  # ~1.6 MB of text at ~2 bytes per token (vocab 512)
    assert load_datasets(cfg).data_dir == ds.data_dir  # warm: the same prepared directory


def test_cli_prepare(tmp_path, capsys):
    write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    args = ["prepare", "--input", str(tmp_path / "in" / "c.jsonl"), "--input", str(tmp_path / "in" / "a.txt"),
            "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert f"{index['splits']['train']['tokens']:,d} tokens" in printed and "uint16" in printed
    assert index["vocab_size"] == 300 and index["splits"]["train"]["documents"] + \
        index["splits"]["val"]["documents"] == 24
    assert main(args) == 0 and "already up to date" in capsys.readouterr().out
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe binary")
    assert main(["prepare", "--input", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o2")]) == 2
    assert "bad.txt: not UTF-8 text (byte 0xff at offset 0)" in capsys.readouterr().err
    assert main(["prepare", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "o3"),
                 "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
