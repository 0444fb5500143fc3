"""Hugging Face interop: each supported architecture against transformers itself, tiny fp32 models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, MistralConfig,  # noqa: E402
                          PreTrainedTokenizerFast, Qwen2Config)

from fivefold.cli import main  # noqa: E402
from fivefold.config import ConfigError
from fivefold.config_load import load_config  # noqa: E402
from fivefold.commands.interop import parse_size  # noqa: E402
from fivefold.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer  # noqa: E402
from fivefold.interop.hf import (TOKENIZER_FILES, config_from_hf, export_hf, hf_config_from, import_hf,  # noqa: E402
                                 read_hf_tensors)
from fivefold.checkpoint.store import resolve_checkpoint  # noqa: E402

# fp32 on CPU, same op order up to matmul blocking: observed differences are ~1e-7.
ATOL, RTOL = 1e-5, 1e-5
VOCAB = 160


def _llama_like(cls, **kw):
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, **kw)


CASES = {
    "llama-gqa": lambda: _llama_like(LlamaConfig, rope_theta=10000.0),
    # Legacy rope_theta/rope_scaling keywords: transformers 5 turns them into rope_parameters.
    # original_max_position_embeddings=64 puts head-dim frequencies in all three llama3 bands.
    "llama3-rope-scaling": lambda: _llama_like(
        LlamaConfig, head_dim=32, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "mistral": lambda: _llama_like(MistralConfig, sliding_window=None),
    "qwen2-tied": lambda: _llama_like(Qwen2Config, tie_word_embeddings=True),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                               bos_token_id=0, eos_token_id=0),
}


def _hf_model(case: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES[case](), attn_implementation="eager").eval()
    with torch.no_grad():  # move norms and biases off their 1/0 init so a mis-mapped one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_import_then_export_matches_transformers(case, ids, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    reference = _logits(hf, ids)

    cfg, model = import_hf(tmp_path / "hf")
    assert cfg.rope_scaling == ("llama3" if case == "llama3-rope-scaling" else "none")
    assert sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    torch.testing.assert_close(_logits(model, ids), reference, atol=ATOL, rtol=RTOL)

    out = export_hf(model, tmp_path / "export")
    assert config_from_hf(json.loads((out / "config.json").read_text())) == cfg
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:  # renames, splits and transposes only: bit-exact
        torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0)
    torch.testing.assert_close(_logits(_load_hf(out), ids), reference, atol=ATOL, rtol=RTOL)


def test_sharded_export_round_trips(ids, tmp_path):
    hf = _hf_model("llama-gqa")
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _, model = import_hf(tmp_path / "hf")
    out = export_hf(model, tmp_path / "export", max_shard_bytes=40_000)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = read_hf_tensors(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)

    _, again = import_hf(out)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(_logits(_load_hf(out), ids), _logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_bf16_checkpoint_imports_as_fp32(ids, tmp_path):
    hf = _hf_model("mistral").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _, model = import_hf(tmp_path / "hf")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # bf16 -> fp32 is exact, so the reference is transformers running the same weights in fp32
    # (reloaded rather than hf.float(), which would keep its rotary table rounded to bf16).
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["qwen2-tied", "gpt2"])
def test_cli_import_and_export(case, ids, tmp_path, capsys):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)

    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f"imported {hf.num_parameters():,d} parameters" in out
    assert "has no tokenizer.json; pass --tokenizer" in out
    assert (tmp_path / "ckpt" / "latest").is_file()
    assert not (resolve_checkpoint(tmp_path / "ckpt") / "tokenizer.json").exists()
    # No tokenizer to be found: a one-line error that says what to pass, not a traceback.
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fivefold generate: error: no tokenizer at ") and "pass --tokenizer" in err
    assert err.count("\n") == 1
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--max-shard-size", "50KB"]) == 0
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    torch.testing.assert_close(_logits(_load_hf(tmp_path / "out"), ids), _logits(hf, ids), atol=ATOL, rtol=RTOL)


TOKENIZER_VOCAB = 300  # a byte-level BPE needs >= 257
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def hf_dir_with_tokenizer(tmp_path_factory):
    """A tiny Llama saved by transformers next to a byte-level BPE saved by transformers (tokenizer.json +
    tokenizer_config.json), a special_tokens_map.json, and the generation_config.json save_pretrained writes."""
    path = tmp_path_factory.mktemp("hf-tok")
    docs = ["The quick brown fox jumps over the lazy dog.", "A quick brown dog outpaces a lazy fox!",
            "def add(x, y):\n    return x + y\n", "Numbers: 1, 22, 333 and 4444."] * 8
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(docs, TOKENIZER_VOCAB),
                                        eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    tokenizer.save_pretrained(path)
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN}))
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    bos_token_id=eos, eos_token_id=eos), attn_implementation="eager").eval()
    model.save_pretrained(path, safe_serialization=True)
    assert {p.name for p in path.iterdir()} >= set(TOKENIZER_FILES)
    return path


def test_import_copies_tokenizer_and_generate_finds_it(hf_dir_with_tokenizer, tmp_path, capsys):
    src = hf_dir_with_tokenizer
    assert main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert "copied tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    ckpt = resolve_checkpoint(tmp_path / "ckpt")
    for name in TOKENIZER_FILES:
        assert (ckpt / name).read_bytes() == (src / name).read_bytes(), name
    assert not any(".tmp-" in p.name for p in (tmp_path / "ckpt").iterdir())

    # The checkpoint's tokenizer encodes the prompt exactly as transformers' tokenizer of the HF dir does.
    hf_tok = AutoTokenizer.from_pretrained(src)
    prompt_ids = hf_tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert load_tokenizer(ckpt / "tokenizer.json").encode(PROMPT).ids == prompt_ids
    assert len(prompt_ids) > 1

    # Greedy `fivefold generate` with no --tokenizer prints what transformers generates from those ids.
    hf = _load_hf(src)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                               pad_token_id=hf.config.eos_token_id)[0, len(prompt_ids):].tolist()
    expected = [t for t in expected if t != hf.config.eos_token_id]
    assert expected, "the random model stopped at once; pick another seed"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "8", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text == PROMPT + hf_tok.decode(expected) + "\n"
    assert len(text) > len(PROMPT) + 1


def test_export_writes_tokenizer_files_back(hf_dir_with_tokenizer, tmp_path, capsys):
    src = hf_dir_with_tokenizer
    assert main(["import-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert "with tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    for name in TOKENIZER_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    assert not any(".tmp-" in p.name for p in (tmp_path / "out").iterdir())
    # transformers loads the exported directory as a whole: same encoding, same model outputs.
    out_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert out_tok(PROMPT)["input_ids"] == AutoTokenizer.from_pretrained(src)(PROMPT)["input_ids"]
    ids = torch.tensor([out_tok(PROMPT, add_special_tokens=False)["input_ids"]])
    torch.testing.assert_close(_logits(_load_hf(tmp_path / "out"), ids), _logits(_load_hf(src), ids),
                               atol=ATOL, rtol=RTOL)


def test_export_of_a_trained_tokenizer_gives_transformers_its_end_and_chat_template(tmp_path, capsys):
    """A run's own tokenizer comes as tokenizer.json alone; export-hf adds a tokenizer_config.json, so that
    AutoTokenizer knows the end-of-sequence token and the context, and renders chats as fivefold serve does."""
    from fivefold.checkpoint.store import save_model
    from fivefold.config import Config, ModelConfig
    from fivefold.data.chat import ChatTemplate
    from fivefold.model import build_model

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n", "The quick brown fox."] * 20, 300)
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                      max_seq_len=128, eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    save_model(tmp_path / "ckpt", Config(model=cfg), build_model(cfg, seed=0),
               extra_files={"tokenizer.json": tokenizer.to_str().encode()})
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert "with tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok.eos_token == EOS_TOKEN and hf_tok.eos_token_id == cfg.eos_token_id
    assert hf_tok.model_max_length == 128
    assert hf_tok(PROMPT)["input_ids"] == tokenizer.encode(PROMPT).ids
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Add one"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ChatTemplate(None, "", EOS_TOKEN).render(messages)


def test_pickled_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CASES["llama-gqa"]().to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(FileNotFoundError, match="pytorch_model.*never loads"):
        import_hf(tmp_path)
    assert main(["import-hf", str(tmp_path), "--out", str(tmp_path / "ckpt")]) == 2
    assert "safe_serialization=True" in capsys.readouterr().err


def test_unsupported_features_name_the_field():
    llama = {**CASES["llama-gqa"]().to_dict(), "architectures": ["LlamaForCausalLM"]}
    llama.pop("rope_parameters", None)
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        config_from_hf({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="rope_type='linear'"):
        config_from_hf({**llama, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        config_from_hf({**llama, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="architectures=\\['BertForMaskedLM'\\]"):
        config_from_hf({**llama, "architectures": ["BertForMaskedLM"]})
    mistral = {**llama, "architectures": ["MistralForCausalLM"], "sliding_window": 32}
    with pytest.warns(UserWarning, match="sliding_window=32"):
        config_from_hf(mistral)
    cfg = config_from_hf(llama)
    with pytest.raises(ConfigError, match="arch='gpt2' needs model.position='learned'"):
        hf_config_from(cfg, "gpt2")
    with pytest.raises(ConfigError, match="arch='qwen2' needs model.qkv_bias=True"):
        hf_config_from(cfg, "qwen2")
    with pytest.raises(ConfigError, match="model.num_experts=8: a mixture of experts has no Hugging Face layout"):
        hf_config_from(load_config(preset="tiny-moe").model)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000
    for bad in ("5 parsecs", "0", "-5GB", "1.2.3GB"):
        with pytest.raises(Exception, match="write a positive size"):
            parse_size(bad)
