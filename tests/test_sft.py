"""Supervised fine-tuning data: exact loss masks for both formats, packing, packed loss == padded loss,
truncation, bad input, the demo set, and the trainer (one process and dp=2) on SFT rows."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fivefold.config_load import load_config
from fivefold.data.dataset import DataError, ResumableSampler
from fivefold.data.load import load_datasets
from fivefold.data.tokenizer import eos_id, tokenizer_sha, train_tokenizer, vocab_size
from fivefold.data.sft_demo import DEMO_PATH, demo_examples, demo_lines
from fivefold.data.sft import (Example, SFTWarning, build_rows, read_examples, sft_tokenizer,
                                   tokenize_example)
from fivefold.model import ForwardContext, build_model, doc_ids_from_tokens
from fivefold.data.chat import ChatTemplate
from fivefold.data.labels import IGNORE_INDEX
from fivefold.train.loss import token_loss_sum

from parity import assert_parity, launch_layouts

CHAT = [("system", "Answer briefly."), ("user", "What is 2 + 3?"), ("assistant", "5"),
        ("user", "Uppercase: ok"), ("assistant", "OK")]
# A ChatML-style template of the kind models ship in tokenizer_config.json.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


GOOD = '{"prompt": "a", "completion": "b"}'
SHORT = [{"prompt": f"What is {i} + 1?\n", "completion": str(i + 1)} for i in range(10)]


def write_jsonl(path: Path, examples) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Demo examples (both formats, some two-turn chats) that fit 64 tokens, and a BPE trained on their text."""
    root = tmp_path_factory.mktemp("sft")
    examples = demo_examples(80)
    texts = [e.get("prompt", "") + e.get("completion", "") + "".join(f"<|{m['role']}|>\n{m['content']}\n"
                                                                    for m in e.get("messages", []))
             for e in examples]
    tokenizer = train_tokenizer(texts, 512)
    tokenizer.save(str(root / "tokenizer.json"))
    examples = [e for e, text in zip(examples, texts) if len(tokenizer.encode(text).ids) < 56]
    assert len(examples) > 60 and sum("messages" in e for e in examples) > 10
    return {"root": root, "sft": write_jsonl(root / "sft.jsonl", examples), "tokenizer": root / "tokenizer.json",
            "tok": tokenizer}


def sft_config(files, tmp_path, **overrides):
    values = {"train.seq_len": 64, "train.micro_batch_size": 4, "train.steps": 3, "train.lr": 1e-2,
              "train.warmup_steps": 1, "train.peak_flops": 1e11, "train.progress": False,
              "train.tensorboard": False, "train.eval_every": 0, "train.log_every": 1, "train.eps": 1e-6,
              "model.vocab_size": vocab_size(files["tok"]), "model.document_mask": True,
              "data.sft": files["sft"], "data.tokenizer": files["tokenizer"], "data.val_fraction": 0.1,
              "data.cache_dir": files["root"] / "cache", "train.out_dir": tmp_path / "run", **overrides}
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])


def encode(tok, text, special=False):
    return tok.encode(text, add_special_tokens=special).ids


# -- masks ---------------------------------------------------------------------------------------------------

def test_prompt_completion_counts_only_the_completion_and_eos(files):
    tok = files["tok"]
    ids, targets = tokenize_example(Example("x:1", "What is 2 + 3?\n", "5 apples"), tok, ChatTemplate(), 0)
    prompt, completion = encode(tok, "What is 2 + 3?\n", True), encode(tok, "5 apples")
    assert ids.tolist() == prompt + completion + [0]
    assert targets.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)


@pytest.mark.parametrize("source", [None, CHATML])
def test_chat_counts_only_assistant_turns_and_one_eos(files, source):
    tok = files["tok"]
    if source is None:  # fivefold's default template, written out
        pieces = [("<|system|>\nAnswer briefly.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n", False), ("5\n", True),
                  ("<|user|>\nUppercase: ok\n<|assistant|>\n", False), ("OK\n", True)]
    else:  # a reply span ends with the template's end-of-turn text
        pieces = [("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                   "<|im_start|>assistant\n", False), ("5<|im_end|>\n", True),
                  ("<|im_start|>user\nUppercase: ok<|im_end|>\n<|im_start|>assistant\n", False),
                  ("OK<|im_end|>\n", True)]
    # A trailing user turn is dropped: nothing after the last reply is trained on.
    example = Example("x:1", messages=tuple(CHAT) + (("user", "thanks"),))
    ids, targets = tokenize_example(example, tok, ChatTemplate(source), 0)
    expected = [(i, t) for text, t in pieces for i in encode(tok, text)] + [(0, True)]
    assert list(zip(ids.tolist(), targets.tolist())) == expected
    assert tok.decode(ids[targets].tolist(), skip_special_tokens=False) == "".join(
        text for text, t in pieces if t) + "<|endoftext|>"


def test_chat_template_comes_from_the_model_directory(files, tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    files["tok"].save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    tok, template, where = sft_tokenizer(sft_config(files, tmp_path, **{"data.tokenizer": "",
                                                                        "train.init_from": model}))
    assert tokenizer_sha(tok) == tokenizer_sha(files["tok"]) and template.source == CHATML
    assert "train.init_from" in where


# -- rows ----------------------------------------------------------------------------------------------------

def split_at_eos(tokens: np.ndarray, targets: np.ndarray, eos: int) -> list[tuple[tuple, tuple]]:
    """The pieces of every row, each ending with an eos (an example, or one padding token)."""
    pieces = []
    for row, mask in zip(tokens.tolist(), targets.tolist()):
        start = 0
        for end in (i + 1 for i, t in enumerate(row) if t == eos):
            pieces.append((tuple(row[start:end]), tuple(mask[start:end])))
            start = end
        assert start == len(row)  # a row ends with an example's eos or padding
    return pieces


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_rows_hold_every_example_whole_and_separated_by_eos(files, packing):
    tok, eos = files["tok"], eos_id(files["tok"])
    encoded = [tokenize_example(e, tok, ChatTemplate(), eos) for e in read_examples(files["sft"])]
    tokens, targets = build_rows(encoded, 65, packing, eos, seed=3)
    pieces = split_at_eos(tokens, targets, eos)
    padding = [p for p in pieces if p == ((eos,), (False,))]
    examples = [p for p in pieces if p != ((eos,), (False,))]
    assert Counter(examples) == Counter((tuple(i.tolist()), tuple(t.tolist())) for i, t in encoded)
    assert len(padding) == tokens.size - sum(len(i) for i, _ in encoded)
    if packing == "pad":
        assert len(tokens) == len(encoded) and all(r[0] != eos for r in tokens)
    else:
        assert len(tokens) < len(encoded) / 3  # short examples share rows
        again, _ = build_rows(encoded, 65, packing, eos, seed=3)
        assert np.array_equal(tokens, again)  # deterministic


def test_pairs_mask_everything_but_targets(files, tmp_path):
    data = load_datasets(sft_config(files, tmp_path)).train
    inputs, labels = data.pairs(range(len(data)))
    assert inputs.shape == labels.shape == (len(data), 64) and inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], torch.from_numpy(data.tokens[:, 1:-1]).long())
    keep = torch.from_numpy(data.targets[:, 1:])
    assert torch.equal(labels[keep], torch.from_numpy(data.tokens[:, 1:]).long()[keep])
    assert (labels[~keep] == IGNORE_INDEX).all() and keep.sum() == data.stats.target_tokens
    with pytest.raises(IndexError):
        data.pairs([len(data)])


def test_packed_loss_equals_padded_loss(files, tmp_path):
    """With document masking, each example's token losses are the same packed with others as alone."""
    sets = {p: load_datasets(sft_config(files, tmp_path, **{"data.sft_packing": p})) for p in ("pack", "pad")}
    cfg = sft_config(files, tmp_path)
    model = build_model(cfg.model, seed=7)
    sums = {}
    with torch.no_grad():
        for packing, data in sets.items():
            inputs, labels = data.train.pairs(range(len(data.train)))
            sums[packing] = (token_loss_sum(model, inputs, labels, cfg).double(), (labels != IGNORE_INDEX).sum())
    assert len(sets["pack"].train) * 3 < len(sets["pad"].train)
    assert sums["pack"][1] == sums["pad"][1] > 100
    torch.testing.assert_close(sums["pack"][0], sums["pad"][0], rtol=1e-5, atol=0)


# -- truncation, splits, bad input -----------------------------------------------------------------------

def test_long_examples_are_cut_with_one_warning(files, tmp_path):
    long = {"prompt": "Spell it:\n", "completion": " ".join(["python"] * 40)}
    path = write_jsonl(tmp_path / "long.jsonl", [long, long | {"prompt": "Again:\n"}] + SHORT)
    cfg = sft_config(files, tmp_path, **{"data.sft": path, "train.seq_len": 32})
    with pytest.warns(SFTWarning, match=r"long.jsonl: 2 of 12 examples are longer than train.seq_len \+ 1 = 33"):
        data = load_datasets(cfg)
    assert data.train.stats.truncated + data.val.stats.truncated == 2
    tok = files["tok"]
    cut = encode(tok, "Spell it:\n", True) + encode(tok, long["completion"])
    rows = [r.tolist() for r in np.concatenate([data.train.tokens, data.val.tokens])]
    assert cut[:33] in rows  # the start kept, the end (and its eos) cut, alone in its row
    path = write_jsonl(tmp_path / "all_long.jsonl", [long, long | {"prompt": "Again:\n"}])
    with pytest.raises(DataError, match="all 2 examples are longer than train.seq_len"):
        load_datasets(sft_config(files, tmp_path, **{"data.sft": path, "train.seq_len": 32}))


def test_validation_split_is_never_empty(files, tmp_path):
    path = write_jsonl(tmp_path / "three.jsonl", demo_examples(3))
    data = load_datasets(sft_config(files, tmp_path, **{"data.sft": path, "data.val_fraction": 0.01}))
    assert (data.train.stats.examples, data.val.stats.examples) == (2, 1)
    path = write_jsonl(tmp_path / "one.jsonl", demo_examples(1))
    with pytest.raises(DataError, match="one.jsonl: one example; fine-tuning needs at least two"):
        load_datasets(sft_config(files, tmp_path, **{"data.sft": path}))




@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "completion": ', "not valid JSON"),
    ('["a", "b"]', "an array, not an object"),
    ('{"prompt": "a"}', '"completion" is missing'),
    ('{"prompt": "a", "completion": "  "}', '"completion" is empty'),
    ('{"prompt": 3, "completion": "b"}', '"prompt" is a number, not a string'),
    ('{"text": "a"}', 'no "prompt"/"completion" or "messages" field'),
    ('{"prompt": "a", "completion": "b", "messages": []}', 'has both "messages" and "prompt"'),
    ('{"messages": "hi"}', '"messages" must be a non-empty array'),
    ('{"messages": [{"role": "user"}]}', 'messages[0] has no "content"'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', 'no "assistant" turn'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}',
     'messages[1] "content" is empty'),
    ('{"prompt": "\\ud800", "completion": "b"}', "lone surrogate"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(DataError, match=f"bad.jsonl:3: .*{re.escape(message)}"):
        read_examples(path)


def test_bad_file_is_one_line_from_the_cli(files, tmp_path, capsys):
    from fivefold.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n{oops\n")
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "run")]
    for key, value in {"data.sft": path, "data.tokenizer": files["tokenizer"], "model.document_mask": "true",
                       "model.vocab_size": vocab_size(files["tok"]), "data.cache_dir": tmp_path}.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:2: not valid JSON" in err and "Traceback" not in err


def test_demo_file_is_the_generators_output():
    text = DEMO_PATH.read_text(encoding="utf-8")
    assert text == demo_lines()
    lines = [json.loads(line) for line in text.splitlines()]
    chats = sum("messages" in e for e in lines)
    assert 2000 <= len(lines) <= 4000 and 0 < chats < len(lines)
    assert all(e["messages"][0]["role"] == "system" for e in lines if "messages" in e)


# -- the trainer -------------------------------------------------------------------------------------------

def test_trainer_first_step_loss_is_the_mean_over_target_tokens(files, tmp_path):
    from fivefold.train.trainer import Trainer

    cfg = sft_config(files, tmp_path, **{"train.micro_batch_size": 2, "train.grad_accum": 2})
    trainer = Trainer(cfg, quiet=True)
    rows = ResumableSampler(len(trainer.data.train), cfg.train.seed).take(4)
    inputs, labels = trainer.data.train.pairs(rows)
    assert 0 < (labels != IGNORE_INDEX).float().mean() < 0.5  # prompts and padding are masked

    def direct_mean(inputs, labels):
        ctx = ForwardContext(doc_ids=doc_ids_from_tokens(inputs, cfg.model.eos_token_id))
        logits = trainer.model(inputs, ctx)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()

    with torch.no_grad():
        expected = direct_mean(inputs, labels)
    history = trainer.fit()
    assert len(history) == 3 and history[0]["loss"] == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():
        val = trainer.data.val
        assert trainer.evaluate() == pytest.approx(direct_mean(*val.pairs(range(len(val)))), rel=1e-5)
    assert 0 < trainer.unigram_loss() < 10
    # A fivefold run's own tokenizer.json is what a fine-tune from it uses when data.tokenizer is unset.
    tok, _, where = sft_tokenizer(sft_config(files, tmp_path, **{"data.tokenizer": "",
                                                                 "train.init_from": tmp_path / "run"}))
    assert tokenizer_sha(tok) == tokenizer_sha(files["tok"]) and "train.init_from" in where


def test_data_parallel_matches_one_process(files, tmp_path):
    """dp=2 (gloo, each rank its half of every global batch) against one process: the same losses, gradient
    norms and final weights on SFT rows, whose target counts differ from row to row."""
    from fivefold.train.trainer import Trainer

    steps = {"train.steps": 4}
    Trainer(sft_config(files, tmp_path / "one", **steps), quiet=True).fit()
    dp = sft_config(files, tmp_path / "dp", **steps, **{"parallel.dp": 2, "train.micro_batch_size": 1,
                                                        "train.grad_accum": 2})
    launch_layouts(2, [{"config": dp.to_dict()}], tmp_path / "runs.json", timeout=120)
    assert_parity(tmp_path / "dp" / "run", tmp_path / "one" / "run", steps=4)
