"""Every `ConfigError` the rest of the suite never raised (tests/error_coverage.py lists them), provoked
through the entry point a user hits: a config file or --set overrides (load_config), a `fivefold` command,
the training and serving APIs (Trainer through `fivefold train`, LLM), the Hugging Face loader with a
hand-written config.json, and serving workload specs. Each test checks that the message names the key or
flag at fault and the change that fixes it, the promise "bad input gets a clear error" makes.

Commands run in this process through the parser and the command's function, less cli.main's boundary
(which turns the error into one line and exit code 2; tests/test_bad_inputs.py checks that boundary), so
the ConfigError itself reaches pytest.raises. Everything is CPU-only, tiny models, no torchrun."""

import json
import re
import shutil

import pytest
import torch

from fivefold import cli
from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.data.tokenizer import save_tokenizer, train_tokenizer
from fivefold.interop.hf import export_hf, import_hf
from fivefold.model import build_model
from fivefold.serve import LLM
from fivefold.serve.workload import parse_workload

TINY = ["--preset", "tiny"]


def says(*parts):
    """pytest.raises(ConfigError) whose message holds `parts` (literal text) in this order: typically the
    key or flag at fault, then the fix it suggests."""
    return pytest.raises(ConfigError, match="(?s)" + ".*".join(map(re.escape, parts)))


def fivefold(*argv):
    """`fivefold ARGV` in this process, as cli.main runs it but without its error boundary."""
    args = cli.build_parser().parse_args([str(a) for a in argv])
    return args.func(args)


def tiny_model(preset="tiny", *overrides):
    """A fresh seeded model: an engine with adapters changes its model in place, so none is shared."""
    return build_model(load_config(preset=preset, overrides=list(overrides)).model, seed=0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The 'tiny' model as a Hugging Face directory (config.json + safetensors) with no tokenizer.json."""
    return export_hf(tiny_model(), tmp_path_factory.mktemp("hf") / "tiny")


def test_the_boundary_prints_these_errors_as_one_line_with_exit_code_2(capsys):
    """The helper above skips cli.main's boundary; this is what the user sees of the same errors."""
    assert cli.main(["plan", *TINY, "--fit"]) == 2
    err = capsys.readouterr().err
    assert err == ("fivefold plan: error: --fit fills the device memory: give it with --device-memory 80GB or "
                   "--cluster PROFILE (or --device cpu for this host's)\n")


# -- config files and --set overrides -------------------------------------------------------------------------


@pytest.mark.parametrize("text, parts", [
    ("preset = 'tiny'\n[train]\nsteps = true\n", ["train.steps=True is not valid", "expected an integer"]),
    ("train = 5\n", ["config section 'train' must be a table of key = value"]),
], ids=["boolean-for-an-integer", "section-not-a-table"])
def test_a_config_file_of_the_wrong_toml_types_names_the_key(text, parts, tmp_path):
    """TOML types values itself, so these reach the config as a bool or an int where --set would give text."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    with says(*parts):
        load_config(path)


@pytest.mark.parametrize("preset, overrides, parts", [
    ("tiny", ["model.num_experts=4", "model.activation=gelu"],
     ["model.num_experts>0 needs model.activation=swiglu"]),
    ("tiny", ["parallel.pp=2", "parallel.pp_layers=one,one"],
     ["parallel.pp_layers='one,one' must be comma-separated layer counts"]),
    ("tiny-gpt2", ["lora.r=8", "lora.targets=q,v,gate"],
     ["lora.targets names gate", "model.activation=gelu has no gate projection", "drop gate"]),
    ("tiny", ["lora.r=8", "lora.init_from={tmp}/no-adapter"],
     ["lora.init_from=", "is not a directory", "give a PEFT adapter directory"]),
    ("tiny", ["data.sft=demo"],
     ["data.sft with data.sft_packing=pack", "set model.document_mask=true, or data.sft_packing=pad"]),
], ids=["experts-need-swiglu", "pp-layers-not-numbers", "lora-gate-on-gelu", "lora-init-from-missing",
        "sft-packing-without-document-mask"])
def test_overrides_that_do_not_fit_the_model_name_the_keys_and_the_fix(preset, overrides, parts, tmp_path):
    with says(*parts):
        load_config(preset=preset, overrides=[o.format(tmp=tmp_path) for o in overrides])


# -- devices ---------------------------------------------------------------------------------------------------


def test_a_device_that_is_neither_cpu_nor_cuda_is_refused(tmp_path):
    """`meta` is a torch device, so only the cpu/cuda rule catches it (before calibrate measures anything)."""
    with says("--device meta: fivefold runs on cpu or cuda", "use auto, cpu, cuda or cuda:N"):
        fivefold("calibrate", "--device", "meta", "--out", tmp_path / "profile.toml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_training_on_cuda_without_cuda_suggests_the_cpu(tmp_path, data_cache):
    with says("train.device='cuda' but CUDA is not available", "use train.device=cpu or train.device=auto"):
        fivefold("train", *TINY, "--out", tmp_path / "run", "--set", "train.device=cuda",
                 "--set", f"data.cache_dir={data_cache}")


@pytest.mark.parametrize("command", ["generate", "serve", "quantize"])
def test_each_command_names_its_own_device_flag(command, tmp_path, hf_dir):
    """A command's --device is quoted as the flag the user typed, not as train.device, and is checked before
    any weights are read (the model path here does not exist for the ones that would read it first)."""
    missing = tmp_path / "no-such-model"
    argv = {"generate": ["generate", "--checkpoint", hf_dir, "--tokenizer", "tok.json", "--prompt", "hi"],
            "serve": ["serve", hf_dir],
            "quantize": ["quantize", missing, "--method", "int8"]}[command]
    with says("--device gpu0 is not a device", "use auto, cpu, cuda or cuda:N"):
        fivefold(*argv, "--device", "gpu0")


def test_the_python_api_names_its_device_argument(hf_dir):
    with says("device='meta': fivefold runs on cpu or cuda"):
        LLM(hf_dir, device="meta")


# -- training data ---------------------------------------------------------------------------------------------

WORDS = "the cat sat on a mat while dogs ran far over hills and rivers under grey skies".split()


def write_corpus(path, documents: int, words: int = 60, seed: int = 0):
    """A .jsonl corpus of `documents` documents of `words` words each, drawn from WORDS."""
    rng = torch.Generator().manual_seed(seed)
    rows = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=rng).tolist())
            for _ in range(documents)]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared dataset of a few thousand tokens, with its own 300-token BPE."""
    root = tmp_path_factory.mktemp("prepared")
    fivefold("prepare", "--input", write_corpus(root / "corpus.jsonl", 40), "--out", root / "data",
             "--vocab-size", 300, "--val-fraction", 0.2)
    return root / "data"


TRAIN_SETTINGS = ["train.progress=false", "train.tensorboard=false", "train.eval_every=0", "train.seq_len=32",
                  "train.micro_batch_size=4", "train.peak_flops=1e11"]


def test_a_sequence_longer_than_the_data_says_how_long_it_may_be(prepared):
    from fivefold.data.load import load_datasets

    cfg = load_config(preset="tiny", overrides=[*TRAIN_SETTINGS, f"data.dataset={prepared}",
                                                "train.seq_len=100000"])
    with says("the train split of", "fewer than train.seq_len + 1 = 100001", "set train.seq_len to at most"):
        load_datasets(cfg)


def test_a_tokenizer_other_than_the_datasets_is_refused(prepared, tmp_path):
    """Token ids mean nothing under another tokenizer than the one the shards were encoded with."""
    from fivefold.data.load import load_datasets

    save_tokenizer(train_tokenizer(["some quite different text to learn merges from"] * 10, 280),
                   tmp_path / "other.json")
    cfg = load_config(preset="tiny", overrides=[*TRAIN_SETTINGS, f"data.dataset={prepared}",
                                                f"data.tokenizer={tmp_path / 'other.json'}"])
    with says("data.tokenizer=", "differs from the tokenizer", "unset data.tokenizer or prepare the data with it"):
        load_datasets(cfg)


def test_resuming_on_a_dataset_that_shrank_under_the_run_is_refused(tmp_path):
    """data.dataset is the same path, so the config allows the resume; the data sampler's position (4
    windows after one step) is past the end of the re-prepared, smaller training split."""
    data, run = tmp_path / "data", tmp_path / "run"
    fivefold("prepare", "--input", write_corpus(tmp_path / "big.jsonl", 40), "--out", data, "--vocab-size", 300,
             "--val-fraction", 0.2)
    train = ["train", *TINY, "--out", run, *(a for s in TRAIN_SETTINGS for a in ("--set", s)),
             "--set", f"data.dataset={data}", "--set", "train.steps=1"]
    assert fivefold(*train) == 0
    tokenizer = shutil.copy(data / "tokenizer.json", tmp_path / "tokenizer.json")
    fivefold("prepare", "--input", write_corpus(tmp_path / "small.jsonl", 3, words=25, seed=1), "--out", data,
             "--tokenizer", tokenizer, "--val-fraction", 0.5)
    splits = json.loads((data / "index.json").read_text())["splits"]
    assert 33 <= splits["val"]["tokens"] and 33 <= splits["train"]["tokens"] < 4 * 32 + 1, splits
    with says("cannot resume", "sampler state", "does not fit", "prepared again",
              "Resume on the data the run started with"):
        fivefold(*train[:-1], "train.steps=2")


def sft_train(tmp_path, data_cache, *overrides):
    return fivefold("train", *TINY, "--out", tmp_path / "run", "--set", "data.sft=demo",
                    "--set", "model.document_mask=true", "--set", f"data.cache_dir={data_cache}",
                    *(a for o in overrides for a in ("--set", o)))


def test_fine_tuning_from_a_missing_model_names_what_to_give(tmp_path, data_cache):
    with says("train.init_from=", "does not exist", "give a Hugging Face model directory or a fivefold run"):
        sft_train(tmp_path, data_cache, f"train.init_from={tmp_path / 'no-model'}")


def test_fine_tuning_from_a_model_without_a_tokenizer_asks_for_data_tokenizer(tmp_path, data_cache, hf_dir):
    """Chat examples must be encoded with the model's tokenizer; a weights-only directory lacks it."""
    with says("train.init_from=", "has no tokenizer.json", "set data.tokenizer to the model's tokenizer.json"):
        sft_train(tmp_path, data_cache, f"train.init_from={hf_dir}")


def test_fine_tuning_a_vocabulary_too_small_for_a_byte_level_bpe(tmp_path, data_cache):
    with says("model.vocab_size=100 is too small to train a byte-level BPE", "use at least 257",
              "or set data.tokenizer"):
        sft_train(tmp_path, data_cache, "model.vocab_size=100")


# -- fivefold plan and fivefold pipeline -------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--headroom", "0.1"], ["--grow-batch"]], ids=["headroom", "grow-batch"])
def test_fit_options_without_fit_ask_for_fit(flags):
    with says("--headroom and --grow-batch choose how --fit fills memory: add --fit"):
        fivefold("plan", *TINY, *flags)


@pytest.mark.parametrize("flags", [["--search"], ["--sweep", "seq"], ["--serve"], ["--gpus", "8"],
                                   ["--png", "fit.png"]], ids=lambda f: f[0])
def test_fit_with_an_option_that_changes_the_layout_or_output_names_the_one_to_drop(flags):
    with says(f"--fit keeps the config's layout and prints a choice; drop {flags[0]}"):
        fivefold("plan", *TINY, "--fit", "--device-memory", "80GB", *flags)


@pytest.mark.parametrize("argv, parts", [
    (["--fit"], ["--fit fills the device memory: give it with --device-memory 80GB or --cluster PROFILE"]),
    (["--fit", "--device-memory", "80GB", "--grow-batch", "--global-batch", "4M"],
     ["--grow-batch lets the global batch follow the micro-batch, --global-batch fixes it: give one of them"]),
    (["--fit", "--device-memory", "80GB", "--headroom", "1.5"],
     ["--headroom 1.5: give the fraction of memory left free, in [0, 1)"]),
    (["--fit", "--device-memory", "80GB", "--set", "train.batch_schedule=1000:2"],
     ["--fit keeps one global batch", "fit without them (--set train.batch_schedule="]),
], ids=["no-memory", "grow-and-fixed-batch", "headroom-range", "batch-schedule"])
def test_plan_fit_refuses_inputs_it_cannot_fit_for(argv, parts):
    with says(*parts):
        fivefold("plan", *TINY, *argv)


@pytest.mark.parametrize("flags", [["--workload", "default"], ["--search"]], ids=["workload", "search"])
def test_serving_speed_needs_a_hardware_profile(flags):
    with says("--workload and --search with --serve predict speed", "--cluster PROFILE"):
        fivefold("plan", *TINY, "--serve", *flags)


def test_a_kv_pool_sized_as_a_fraction_of_memory_needs_the_memory():
    with says("serve.kv_memory=0.5 is a fraction of free memory: pass --device-memory",
              "or give serve.kv_memory in GB (>= 1) or serve.num_blocks"):
        fivefold("plan", *TINY, "--serve", "--set", "serve.kv_memory=0.5")


@pytest.mark.parametrize("argv, parts", [
    (["--top", "0"], ["--top 0: show at least 1 layout"]),
    (["--global-batch", "1000", "--set", "train.seq_len=256"],
     ["--global-batch 1000 tokens is not a whole number of train.seq_len=256 sequences; use a multiple of 256"]),
    (["--device-memory", "1MB"], ["no layout of this model fits 1 x h200 (1.00 MB each)",
                                  "add devices, shorten train.seq_len or change the global batch"]),
], ids=["top-zero", "global-batch-not-whole-sequences", "nothing-fits"])
def test_plan_search_errors_name_the_flag_and_the_fix(argv, parts):
    with says(*parts):
        fivefold("plan", *TINY, "--cluster", "h200", "--search", *argv)


def test_no_serving_layout_meeting_the_latency_bound_says_to_relax_it():
    """The bound as given, under a millisecond too."""
    with says("no serving layout meets p99 TPOT <= 0.1 ms", "raise --max-tpot or lighten the workload"):
        fivefold("plan", *TINY, "--serve", "--cluster", "h200", "--search", "--max-tpot", "0.0001",
                 "--workload", "requests=4,prompt=8:16,output=4:8")


def test_a_model_whose_weights_fill_the_device_leaves_no_kv_block():
    """llama3-70b's 141 GB of bf16 weights on a 40 GB A100: nothing is left for the KV pool."""
    with says("the KV pool holds no block on this hardware", "raise serve.kv_memory or set serve.num_blocks"):
        fivefold("plan", "--preset", "llama3-70b", "--serve", "--cluster", "a100-40gb",
                 "--workload", "requests=2,prompt=8,output=4")


def test_a_hardware_profile_without_memory_is_refused(tmp_path):
    from fivefold.planner.hardware import PROFILE_DIR

    text = (PROFILE_DIR / "h200.toml").read_text()
    profile = tmp_path / "no-memory.toml"
    profile.write_text(re.sub(r"(?m)^memory_bytes = .*$", "memory_bytes = 0", text))
    with says("hardware profile", "memory_bytes must be > 0"):
        fivefold("hardware", profile)


def test_document_masks_with_context_and_pipeline_parallel_together_are_refused():
    """Not implemented yet, so `plan` refuses it as `train` would, with the alternatives."""
    with says("model.document_mask with parallel.cp>1 and parallel.pp>1 is not supported yet",
              "use one of cp and pp, or model.document_mask=false"):
        fivefold("plan", *TINY, "--set", "parallel.cp=2", "--set", "parallel.pp=2",
                 "--set", "model.document_mask=true")


def test_a_pipeline_picture_needs_two_stages():
    with says("fivefold pipeline needs --pp (or parallel.pp) of at least 2"):
        fivefold("pipeline", *TINY)


# -- fivefold quantize -----------------------------------------------------------------------------------------


def test_int4_of_a_model_with_an_odd_input_width_suggests_int8(tmp_path):
    """int4 packs two columns a byte: the MLP's down projection of a 65-wide FFN cannot be packed."""
    hf = export_hf(tiny_model("tiny", "model.ffn_hidden_size=65"), tmp_path / "odd")
    with says("int4 packs two columns per byte", "layers.*.mlp.down_proj has the odd input width 65",
              "use --method int8"):
        fivefold("quantize", hf, "--method", "int4", "--out", tmp_path / "q")


# -- Hugging Face config.json ----------------------------------------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "eos_token_id": 0}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
        "vocab_size": 512, "n_positions": 128, "eos_token_id": 0}


@pytest.mark.parametrize("config, parts", [
    ({**LLAMA, "rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}},
     ["rope_parameters per layer type is not supported"]),
    ({**LLAMA, "partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5 is not supported"]),
    ({**LLAMA, "eos_token_id": 600}, ["eos_token_id=600 is outside the vocabulary (vocab_size=512); fix config.json"]),
    ({**LLAMA, "eos_token_id": [700, 1]}, ["eos_token_id=700 is outside the vocabulary"]),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq"}},
     ["quantization_config: quantized checkpoints are not supported; use the fp16/bf16/fp32 one"]),
    ({**LLAMA, "attention_bias": True}, ["attention_bias=True with mlp_bias=False is not supported"]),
    ({**GPT2, "activation_function": "relu"}, ["activation_function='relu' is not supported; expected one of"]),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True},
     ["scale_attn_by_inverse_layer_idx=True is not supported by fivefold's GPT-2 (needs False)"]),
    ({**GPT2, "add_cross_attention": True}, ["add_cross_attention=True is not supported by fivefold's GPT-2"]),
], ids=["rope-per-layer-type", "partial-rotary", "eos-outside-vocab", "eos-list-outside-vocab", "quantized",
        "attention-bias-only", "gpt2-activation", "gpt2-scale-by-layer", "gpt2-cross-attention"])
def test_importing_an_unsupported_hugging_face_config_names_the_field(config, parts, tmp_path):
    """Refused from config.json alone, before any weights are read (there are none here)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with says(*parts):
        import_hf(tmp_path)


def test_exporting_to_an_unknown_architecture_lists_the_known_ones(tmp_path):
    """The command line restricts --arch to its choices; export_hf's callers in Python get this."""
    with says("arch='falcon' is not supported; choose one of llama, mistral, qwen2, gpt2"):
        export_hf(tiny_model(), tmp_path / "out", arch="falcon")


# -- serving ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", ["sql", "=runs/sql-lora", "sql="])
def test_serve_lora_that_is_not_name_equals_path_shows_the_form(lora, hf_dir):
    """Refused before the model is loaded."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with says(f"--lora {lora!r} must look like NAME=PATH (e.g. --lora sql=runs/sql-lora)"):
        fivefold("serve", hf_dir, "--device", "cpu", "--lora", lora)


def test_serve_lora_naming_one_adapter_twice_is_refused(hf_dir):
    """Two --lora with one name would otherwise keep the last path silently."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with says("--lora names the adapter 'sql' twice (runs/a and runs/b); give each adapter its own name"):
        fivefold("serve", hf_dir, "--device", "cpu", "--lora", "sql=runs/a", "--lora", "sql=runs/b")


@pytest.mark.parametrize("flags, parts", [
    (["--lora", "sql=runs/sql-lora"], ["LoRA adapters are served with tp=1"]),
    (["--set", "serve.async_scheduling=true"], ["serve.async_scheduling=true cannot be used with tensor parallelism",
                                                "set it to auto"]),
], ids=["lora", "async-scheduling"])
def test_what_tensor_parallel_serving_cannot_do_is_refused_before_launching(flags, parts, hf_dir, monkeypatch):
    """Refused by the command itself: no torchrun is started (the launcher would fail the test if called)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import fivefold.commands.serve as serve_command

    monkeypatch.setattr(serve_command, "launch", lambda *a, **k: pytest.fail("launched torchrun"))
    with says(*parts):
        fivefold("serve", hf_dir, "--device", "cpu", "--tp", 2, *flags)


def test_llm_refuses_adapters_under_tensor_parallelism_before_anything_starts(hf_dir):
    with says("LoRA adapters are served with tp=1"):
        LLM(hf_dir, tp=2, adapters={"sql": "runs/sql-lora"})


def test_tensor_parallel_serving_of_a_model_object_asks_for_torchrun():
    with says("tp=2 serves a model from its path on 2 processes", "torchrun --nproc-per-node 2"):
        LLM(tiny_model(), tp=2)


def test_a_context_beyond_learned_positions_is_refused():
    with says("serve.max_model_len=257 exceeds the learned positions of model.max_seq_len=256"):
        LLM(tiny_model("tiny-gpt2"), max_model_len=257)


@pytest.mark.parametrize("options, parts", [
    ({"kv_memory": 1e-15}, ["serve.kv_memory=1e-15 leaves no room for one KV block", "raise serve.kv_memory"]),
    ({"num_blocks": -1}, ["serve.num_blocks=-1 must be >= 0 (0 = sized from serve.kv_memory)"]),
], ids=["kv-memory-too-small", "num-blocks-negative"])
def test_engine_options_that_leave_no_kv_pool_name_the_option(options, parts):
    with says(*parts):
        LLM(tiny_model(), device="cpu", **options)


@pytest.mark.parametrize("options, parts", [
    ({"block_size": True}, ["serve.block_size=True is not valid; expected an integer"]),
    ({"max_num_seqs": 2.5}, ["serve.max_num_seqs=2.5 is not valid; expected an integer"]),
], ids=["bool-for-a-count", "fraction-for-a-count"])
def test_engine_options_of_the_wrong_type_are_refused_as_set_would(options, parts):
    """Python's bool is an int: unchecked, block_size=True served blocks of one token."""
    with says(*parts):
        LLM(tiny_model(), device="cpu", **options)


@pytest.fixture
def peft_adapter(tmp_path):
    """A rank-4 PEFT adapter for the 'tiny' model (zeros: only its shapes matter here)."""
    from fivefold.finetune.lora import adapter_shapes
    from fivefold.finetune.peft import save_adapter

    cfg = load_config(preset="tiny", overrides=["lora.r=4"])
    tensors = {name: torch.zeros(shape) for name, shape in adapter_shapes(cfg.model, cfg.lora).items()}
    return save_adapter(tensors, cfg, tmp_path / "adapter")


@pytest.mark.parametrize("name", ["", "base:sql"], ids=["empty", "colon"])
def test_an_adapter_name_clients_could_not_address_is_refused(name, peft_adapter, tmp_path):
    """Clients ask for an adapter as model 'BASE:NAME', so a name must be non-empty and free of ':'; the name
    is the error even where the adapter's path is wrong too (it is checked before the weights are read)."""
    for source in (peft_adapter, tmp_path / "no-adapter"):
        with says(f"adapter name {name!r}: give a non-empty name without ':'"):
            LLM(tiny_model(), device="cpu", adapters={name: source})


def test_a_peft_adapter_on_a_gpt2_layout_model_is_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    with says("PEFT adapters are written for the Llama family (RoPE models)", "GPT-2's layout"):
        LLM(tiny_model("tiny-gpt2"), device="cpu", adapters={"sql": tmp_path})


# -- serving workloads (fivefold plan --serve --workload) ------------------------------------------------------


@pytest.mark.parametrize("lines, parts", [
    (['{"prompt": 0, "output": 8}'], [":1: prompt and output must be >= 1, arrival >= 0"]),
    (['{"arrival": -1, "prompt": 8, "output": 8}'], [":1: prompt and output must be >= 1, arrival >= 0"]),
    (["", "   "], ["holds no requests"]),
], ids=["zero-prompt", "negative-arrival", "empty"])
def test_a_workload_trace_with_impossible_requests_names_the_line(lines, parts, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with says("workload trace", *parts):
        parse_workload(str(path))


def test_a_workload_spec_with_a_non_numeric_count_says_which_fields_are_numbers():
    with says("workload 'requests=many,prompt=16': requests and seed are integers, rate a number"):
        parse_workload("requests=many,prompt=16")


# -- library functions behind the config -----------------------------------------------------------------------


def test_apply_kernels_with_an_unknown_choice_lists_the_valid_ones():
    """The config refuses other values first; this is for callers of the library function."""
    from fivefold.kernels import apply_kernels

    with says("train.kernels='cuda' is not valid; choose one of torch, triton"):
        apply_kernels(tiny_model(), "cuda")
