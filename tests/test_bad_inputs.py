"""A catalogue of bad inputs, each run through the real entry point (`fivefold.cli.main`): every one must
end in exit code 2 and a single line `fivefold <command>: error: ...` that names what to change, with no
traceback, before anything is written. Unexpected exceptions are the other side of the boundary: a
traceback and a request to report the bug (exit 1)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fivefold import cli
from fivefold.data.dataset import read_index
from fivefold.train.trainer import Trainer

BASE = ["--preset", "tiny", "--set", "train.progress=false", "--set", "train.tensorboard=false",
        "--set", "train.seq_len=32", "--set", "train.micro_batch_size=4", "--set", "train.steps=2",
        "--set", "train.eval_every=0", "--set", "train.peak_flops=1e11"]

# (id, argv after the command's BASE arguments, text the error must contain). "{x}" names a fixture path.
TRAIN_CASES = [
    ("lr-nan", ["--set", "train.lr=nan"], "train.lr='nan' is not valid; expected a finite number"),
    ("lr-inf", ["--set", "train.lr=inf"], "expected a finite number"),
    ("lr-zero", ["--set", "train.lr=0"], "train.lr=0.0 must be > 0"),
    ("lr-negative", ["--set", "train.lr=-1e-3"], "train.lr=-0.001 must be > 0"),
    ("lr-text", ["--set", "train.lr=fast"], "expected a number"),
    ("warmup-negative", ["--set", "train.warmup_steps=-5"], "train.warmup_steps=-5 must be >= 0"),
    ("grad-clip-negative", ["--set", "train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0 (0 turns clipping off)"),
    ("weight-decay-negative", ["--set", "train.weight_decay=-0.1"], "train.weight_decay=-0.1 must be >= 0"),
    ("save-every-negative", ["--set", "train.save_every=-10"], "train.save_every=-10 must be >= 0"),
    ("eval-every-negative", ["--set", "train.eval_every=-1"], "train.eval_every=-1 must be >= 0"),
    ("eval-batches-zero", ["--set", "train.eval_batches=0"], "train.eval_batches=0 must be >= 1"),
    ("beta1-one", ["--set", "train.beta1=1"], "train.beta1=1.0 must be in [0, 1)"),
    ("beta2-above-one", ["--set", "train.beta2=1.5"], "train.beta2=1.5 must be in [0, 1)"),
    ("eps-negative", ["--set", "train.eps=-1e-8"], "train.eps=-1e-08 must be >= 0"),
    ("min-lr-ratio", ["--set", "train.min_lr_ratio=2"], "train.min_lr_ratio=2.0 must be in [0, 1]"),
    ("decay-fraction-zero", ["--set", "train.decay_fraction=0"], "train.decay_fraction=0.0 must be in (0, 1]"),
    ("steps-negative", ["--set", "train.steps=-1"], "train.steps=-1 must be >= 0"),
    ("steps-fraction", ["--set", "train.steps=1.5"], "expected an integer"),
    ("seq-len-zero", ["--set", "train.seq_len=0"], "train.seq_len=0 must be at least 1"),
    ("micro-batch-zero", ["--set", "train.micro_batch_size=0"], "train.micro_batch_size=0 must be at least 1"),
    ("keep-zero", ["--set", "train.keep_checkpoints=0"], "train.keep_checkpoints=0 must be at least 1"),
    ("seed-negative", ["--set", "train.seed=-1"], "train.seed=-1 must be in [0,"),
    ("device-unknown", ["--set", "train.device=foo"], "train.device='foo' is not valid; use auto, cpu, cuda"),
    ("device-tpu", ["--set", "train.device=tpu:0"], "train.device='tpu:0' is not valid"),
    ("precision", ["--set", "train.precision=fp16"], "choose one of fp32, bf16-mixed"),
    ("recompute", ["--set", "train.recompute=partial"], "choose one of none, selective, ops, full"),
    ("bool", ["--set", "train.tensorboard=maybe"], "expected true or false"),
    ("batch-schedule", ["--set", "train.batch_schedule=soon"], "each entry must be tokens:grad_accum"),
    ("batch-schedule-order", ["--set", "train.batch_schedule=500:2,100:4"], "thresholds must increase"),
    ("fp32-grad-accum", ["--set", "train.fp32_grad_accum=true"], "only applies to train.precision=bf16-mixed"),
    ("batch-ramp-and-schedule", ["--set", "train.batch_ramp=auto", "--set", "train.grad_accum=2", "--set",
                                 "train.max_grad_accum=8", "--set", "train.batch_schedule=1000:4"],
     "remove train.batch_schedule, or use train.batch_ramp=schedule"),
    ("batch-ramp-one-micro-batch", ["--set", "train.batch_ramp=auto", "--set", "train.max_grad_accum=8"],
     "needs train.grad_accum >= 2; set train.grad_accum=2"),
    ("batch-ramp-no-room", ["--set", "train.batch_ramp=auto", "--set", "train.grad_accum=2"],
     "needs train.max_grad_accum > train.grad_accum=2"),
    ("batch-ramp-layout", ["--set", "train.batch_ramp=auto", "--set", "train.grad_accum=2", "--set",
                           "train.max_grad_accum=8", "--set", "parallel.cp=2"],
     "this layout cannot measure: under parallel.cp=2"),
    ("max-grad-accum-without-ramp", ["--set", "train.max_grad_accum=8"], "only applies to train.batch_ramp=auto"),
    ("max-grad-accum-negative", ["--set", "train.max_grad_accum=-1"], "train.max_grad_accum=-1 must be >= 0"),
    ("gns-ema-one", ["--set", "train.gns_ema=1"], "train.gns_ema=1.0 must be in [0, 1)"),
    ("batch-ramp-unknown", ["--set", "train.batch_ramp=fast"], "choose one of schedule, auto"),
    ("kv-heads", ["--set", "model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads=4"),
    ("hidden-heads", ["--set", "model.hidden_size=66"], "not divisible by model.num_heads=4"),
    ("vocab-zero", ["--set", "model.vocab_size=0"], "model.vocab_size=0 must be at least 1"),
    ("vocab-too-small", ["--set", "model.vocab_size=100"], "too small to train a byte-level BPE"),
    ("eos-outside", ["--set", "model.eos_token_id=600"], "model.eos_token_id=600 must be in [0, model.vocab_size=512)"),
    ("norm-eps", ["--set", "model.norm_eps=0"], "model.norm_eps=0.0 must be > 0"),
    ("init-std", ["--set", "model.init_std=-0.02"], "model.init_std=-0.02 must be > 0"),
    ("rope-odd", ["--set", "model.head_dim=15"], "RoPE needs an even head size"),
    ("learned-context", ["--set", "model.position=learned", "--set", "model.max_seq_len=16"],
     "train.seq_len=32 exceeds model.max_seq_len=16"),
    ("capacity-negative", ["--set", "model.capacity_factor=-1"], "model.capacity_factor=-1.0 must be >= 0"),
    ("experts-per-token", ["--set", "model.num_experts=4", "--set", "model.experts_per_token=5"],
     "model.experts_per_token=5 must be in 1..model.num_experts=4"),
    ("dp-zero", ["--set", "parallel.dp=0"], "parallel.dp=0 must be at least 1"),
    ("zero-stage", ["--set", "parallel.zero=4"], "parallel.zero=4 is not valid; choose one of 0, 1, 2, 3"),
    ("compiled-update-zero", ["--set", "train.optimizer_impl=compiled", "--set", "parallel.zero=2"],
     "train.optimizer_impl=compiled steps whole tensors, and parallel.zero=2 shards them"),
    ("tp-heads", ["--set", "parallel.tp=3"], "parallel.tp=3 does not divide model.num_heads=4"),
    ("tp-world", ["--set", "parallel.tp=2"], "world size 1 != dp*tp*pp*cp"),
    ("tp-world-hint", ["--set", "parallel.tp=2", "--set", "parallel.dp=2"], "launch 4 processes (any multiple of tp*pp*cp = 2"),
    ("pp-layers", ["--set", "parallel.pp=4"], "parallel.pp=4 x pp_virtual_stages=1 stages exceed model.num_layers=2"),
    ("ep-no-experts", ["--set", "parallel.ep=2"], "parallel.ep=2 must divide model.num_experts=0"),
    ("bucket", ["--set", "parallel.bucket_mb=0"], "parallel.bucket_mb=0.0 must be > 0"),
    ("val-fraction", ["--set", "data.val_fraction=1"], "data.val_fraction=1.0 must be in (0, 1)"),
    ("unknown-key", ["--set", "train.learning_rate=1"], "unknown config key 'train.learning_rate'"),
    ("unknown-section", ["--set", "optim.lr=1"], "unknown config section 'optim'"),
    ("override-format", ["--set", "train.lr"], "must look like section.key=value"),
    ("override-key", ["--set", "lr=1"], "the key must be section.key"),
    ("preset", ["--preset", "llama9"], "llama9"),
    ("config-missing", ["--config", "{tmp}/none.toml"], "does not exist"),
    ("config-invalid", ["--config", "{bad_toml}"], "is not valid TOML"),
    ("dataset-missing", ["--set", "data.dataset={tmp}/nowhere"], "is not a prepared dataset (no index.json)"),
    ("dataset-vocab", ["--set", "data.dataset={foreign_dataset}"], "holds token id 9999, but model.vocab_size=512"),
    ("dataset-damaged-shard", ["--set", "data.dataset={damaged_dataset}"], "token id 65535 at token"),
    ("init-from-missing", ["--set", "train.init_from={tmp}/none"], "does not exist"),
    ("kernels-triton-no-gpu", ["--set", "train.kernels=triton"], "train.kernels=triton cannot run here"),
    ("kernels-triton-nproc", ["--nproc", "2", "--set", "train.kernels=triton"], "train.kernels=triton cannot run here"),
    ("nproc-zero", ["--nproc", "0"], "argument --nproc: 0 must be at least 1"),
    ("nproc-negative", ["--nproc", "-2"], "argument --nproc: -2 must be at least 1"),
    ("nproc-text", ["--nproc", "two"], "'two' is not an integer"),
    ("unknown-flag", ["--learning-rate", "1"], "unrecognized arguments: --learning-rate 1 (see fivefold train --help)"),
    ("misspelt-flag", ["--nprocs", "2"], "fivefold train: error: unrecognized arguments: --nprocs 2 (did you mean --nproc?)"),
    ("misspelt-key", ["--set", "train.stepz=3"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    ("key-in-another-section", ["--set", "train.tp=2"], "unknown config key 'train.tp' (it is 'parallel.tp')"),
    ("misspelt-section", ["--set", "trian.steps=3"], "unknown config section 'trian' (did you mean 'train'?)"),
    ("resume-seq-len", ["--out", "{run}", "--set", "train.seq_len=16"], "train.seq_len was 32, now 16"),
    ("resume-micro-batch", ["--out", "{run}", "--set", "train.micro_batch_size=2"],
     "the global batch was 4 sequences"),
    ("resume-seed", ["--out", "{run}", "--set", "train.seed=7"], "train.seed was 1234, now 7"),
    ("resume-model", ["--out", "{run}", "--set", "model.ffn_hidden_size=64"], "the model differs (model.ffn_hidden_size)"),
    ("resume-damaged-no-fallback", ["--out", "{damaged_run}", "--no-fallback"], "does not match its checksum"),
    ("resume-all-damaged", ["--out", "{all_damaged_run}"], "no intact checkpoint under"),
    ("resume-no-resume", ["--out", "{run}", "--no-resume"], "already holds a run"),
    ("init-from-damaged", ["--set", "train.init_from={damaged_step}"], "is damaged"),
    ("init-from-hf-bad-json", ["--set", "train.init_from={hf_bad_json}"], "config.json is not valid JSON"),
    ("init-from-hf-bad-weights", ["--set", "train.init_from={hf_bad_weights}"],
     "model.safetensors is not a readable safetensors file"),
    ("tokenizer-missing", ["--set", "data.tokenizer={tmp}/none.json"], "does not exist"),
    ("tokenizer-garbage", ["--set", "data.tokenizer={bad_toml}"], "not a Hugging Face tokenizer.json"),
    ("batch-schedule-zero", ["--set", "train.batch_schedule=100:0"], "grad_accum be >= 1"),
    ("heads-zero", ["--set", "model.num_heads=0"], "model.num_heads=0 must be at least 1"),
    ("config-directory", ["--config", "{tmp}"], "is a directory; give a TOML file"),
    ("out-not-a-directory", ["--out", "{bad_toml}/run"], "Not a directory"),
]

GENERATE_CASES = [
    ("checkpoint-missing", ["--checkpoint", "{tmp}/none", "--prompt", "x"], "no checkpoint found at"),
    ("checkpoint-not-given", ["--prompt", "x"], "give the checkpoint to generate from"),
    ("two-checkpoints", ["{run}", "--checkpoint", "{tmp}/none", "--prompt", "x"], "two checkpoints given"),
    ("prompt-empty", ["--checkpoint", "{run}", "--prompt", ""], "--prompt is empty"),
    ("max-tokens-negative", ["--checkpoint", "{run}", "--prompt", "x", "--max-new-tokens", "-1"],
     "argument --max-new-tokens: -1 must be at least 1"),
    ("max-tokens-zero", ["--checkpoint", "{run}", "--prompt", "x", "--max-new-tokens", "0"], "must be at least 1"),
    ("top-p-zero", ["--checkpoint", "{run}", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ("misspelt-flag", ["{run}", "--prompt", "x", "--max-tokens", "4"],
     "fivefold generate: error: unrecognized arguments: --max-tokens 4 (did you mean --max-new-tokens?)"),
    ("top-p-above-one", ["--checkpoint", "{run}", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("temperature-negative", ["--checkpoint", "{run}", "--prompt", "x", "--temperature", "-1"],
     "--temperature must be >= 0"),
    ("temperature-nan", ["--checkpoint", "{run}", "--prompt", "x", "--temperature", "nan"], "--temperature must be >= 0"),
    ("top-k-negative", ["--checkpoint", "{run}", "--prompt", "x", "--top-k", "-1"], "--top-k must be an integer >= 0"),
    ("tp-zero", ["--checkpoint", "{run}", "--prompt", "x", "--tp", "0"], "argument --tp: 0 must be at least 1"),
    ("beyond-context", ["--checkpoint", "{learned_ckpt}", "--prompt", "x " * 40, "--max-new-tokens", "4"],
     "exceeds the"),
    ("damaged-checkpoint", ["--checkpoint", "{damaged_step}", "--prompt", "x"], "is damaged"),
    ("tokenizer-missing", ["--checkpoint", "{run}", "--prompt", "x", "--tokenizer", "{tmp}/none.json"], "none.json"),
    ("hf-bad-json", ["--checkpoint", "{hf_bad_json}", "--prompt", "x"], "config.json is not valid JSON"),
    ("hf-bad-weights", ["--checkpoint", "{hf_bad_weights}", "--prompt", "x"], "is not a readable safetensors file"),
]

OTHER_CASES = [
    ("plan-preset", ["plan", "--preset", "nope"], "nope"),
    ("plan-tp", ["plan", "--preset", "llama3-8b", "--set", "parallel.tp=3"], "parallel.tp=3 does not divide"),
    ("plan-device-memory", ["plan", "--preset", "tiny", "--device-memory", "lots"], "lots"),
    ("serve-block-size", ["serve", "{run}", "--set", "serve.block_size=0"], "serve.block_size=0 must be at least 1"),
    ("serve-port", ["serve", "{run}", "--port", "99999"], "argument --port: 99999 must be in 0..65535"),
    ("serve-key", ["serve", "{run}", "--set", "train.lr=1"], "serve"),
    ("prepare-missing", ["prepare", "--input", "{tmp}/none.txt", "--out", "{tmp}/ds"], "none.txt"),
    ("prepare-empty", ["prepare", "--input", "{empty_text}", "--out", "{tmp}/ds", "--vocab-size", "300"],
     "empty corpus"),
    ("prepare-vocab", ["prepare", "--input", "{empty_text}", "--out", "{tmp}/ds", "--vocab-size", "100"],
     "--vocab-size=100 is too small"),
    ("prepare-val-fraction", ["prepare", "--input", "{empty_text}", "--out", "{tmp}/ds", "--val-fraction", "2"],
     "val_fraction=2.0 must be in (0, 1)"),
    ("import-missing", ["import-hf", "{tmp}/none", "--out", "{tmp}/ckpt"], "none"),
    ("score-checkpoint-missing", ["score", "{tmp}/none", "--text", "x"], "no checkpoint found at"),
    ("score-text-empty", ["score", "{run}", "--text", ""], "--text is empty; give the text to score"),
    ("score-file-empty", ["score", "{run}", "--file", "{empty_text}"], "empty.txt is empty; give the text to score"),
    ("score-file-missing", ["score", "{run}", "--file", "{tmp}/none.txt"], "none.txt"),
    ("score-one-token", ["score", "{run}", "--text", "x"], "the text is 1 token(s) long; scoring needs at least 2"),
    ("score-window-past-context", ["score", "{run}", "--text", "x y", "--window", "100000"],
     "--window 100000: give 2 to"),
    ("score-stride-past-window", ["score", "{run}", "--text", "x y", "--window", "8", "--stride", "8"],
     "--stride 8: give 1 to 7 (less than --window 8"),
    ("score-text-and-file", ["score", "{run}", "--text", "x", "--file", "{empty_text}"],
     "argument --file: not allowed with argument --text"),
    ("export-missing", ["export-hf", "--checkpoint", "{tmp}/none", "--out", "{tmp}/hf"], "no checkpoint found"),
    ("memory-steps", ["memory", "--preset", "tiny", "--steps", "0"], "argument --steps: 0 must be at least 1"),
    ("plan-device-memory-zero", ["plan", "--preset", "tiny", "--device-memory", "0"], "write a positive size"),
    ("serve-kv-memory", ["serve", "{run}", "--set", "serve.kv_memory=0"], "serve.kv_memory=0.0 must be > 0"),
    ("serve-max-model-len", ["serve", "{run}", "--set", "serve.max_model_len=-1"], "must be >= 0"),
    ("serve-max-scored-tokens", ["serve", "{run}", "--set", "serve.max_scored_tokens=-1"],
     "serve.max_scored_tokens=-1 must be >= 0 (0 = prompts are not scored)"),
    ("serve-huge-pages", ["serve", "{run}", "--set", "serve.huge_pages=maybe"],
     "serve.huge_pages='maybe' is not valid; choose one of auto, true, false"),
    ("serve-compile-decode", ["serve", "{run}", "--set", "serve.compile_decode=true", "--set",
                              "serve.fuse_launches=false"],
     "serve.compile_decode=true compiles the CPU path's loop over the blocks, which this engine does not run"),
    ("serve-missing", ["serve", "{tmp}/none"], "no checkpoint found"),
    ("serve-damaged", ["serve", "{damaged_step}"], "is damaged"),
    ("export-damaged", ["export-hf", "--checkpoint", "{damaged_step}", "--out", "{tmp}/hf"], "is damaged"),
    ("export-shard-size", ["export-hf", "--checkpoint", "{run}", "--out", "{tmp}/hf", "--max-shard-size", "0"],
     "write a positive size"),
    ("import-bad-json", ["import-hf", "{hf_bad_json}", "--out", "{tmp}/ckpt"], "config.json is not valid JSON"),
    ("import-bad-weights", ["import-hf", "{hf_bad_weights}", "--out", "{tmp}/ckpt"], "not a readable safetensors"),
    ("prepare-binary", ["prepare", "--input", "{binary_text}", "--out", "{tmp}/ds", "--vocab-size", "300"],
     "not UTF-8 text"),
    ("unknown-command", ["trian"], "invalid choice: 'trian'"),
    ("plan-cluster-unknown", ["plan", "--preset", "tiny", "--cluster", "dgx9"], "no hardware profile 'dgx9'"),
    ("plan-gpus-zero", ["plan", "--preset", "tiny", "--cluster", "h200", "--gpus", "0"], "--gpus"),
    ("plan-cluster-not-toml", ["plan", "--preset", "tiny", "--cluster", "{bad_toml}"], "is not valid TOML"),
    ("hardware-unknown", ["hardware", "tpu-v9"], "no hardware profile 'tpu-v9'"),
    ("calibrate-nproc", ["calibrate", "--nproc", "0"], "argument --nproc: 0 must be at least 1"),
    ("calibrate-device", ["calibrate", "--device", "gpu0"], "is not a device"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory, data_cache):
    """The files the cases point at: a trained run, damaged copies, datasets, a learned-position model."""
    from fivefold.config_load import load_config
    from fivefold.data.load import load_datasets

    root = tmp_path_factory.mktemp("bad-inputs")
    overrides = [BASE[i + 1] for i in range(2, len(BASE), 2)] + [f"data.cache_dir={data_cache}"]
    cfg = load_config(preset="tiny", overrides=[*overrides, f"train.out_dir={root / 'run'}"])
    Trainer(cfg, quiet=True).fit()
    p = {"tmp": root / "scratch", "run": root / "run"}
    p["tmp"].mkdir()
    step = p["run"] / "checkpoints" / "step_00000002"
    for name in ("damaged_run", "all_damaged_run"):
        shutil.copytree(p["run"], root / name)
        p[name] = root / name
    flip(p["damaged_run"] / "checkpoints" / "step_00000002" / "trainer_state.json")
    flip(p["all_damaged_run"] / "checkpoints" / "step_00000002" / "config.json")
    p["damaged_step"] = p["damaged_run"] / "checkpoints" / "step_00000002"
    p["bad_toml"] = root / "bad.toml"
    p["bad_toml"].write_text("[train\nlr = 1\n")
    p["empty_text"] = root / "empty.txt"
    p["empty_text"].write_text("")
    # Prepared datasets: one whose index records ids beyond the model's vocabulary, one whose shard bytes
    # were overwritten after it was prepared.
    source = load_datasets(cfg).data_dir
    for name in ("foreign_dataset", "damaged_dataset"):
        shutil.copytree(source, root / name)
        p[name] = root / name
    index = read_index(p["foreign_dataset"])
    index["splits"]["train"]["max_token_id"] = 9999
    (p["foreign_dataset"] / "index.json").write_text(json.dumps(index))
    shard = p["damaged_dataset"] / read_index(source)["splits"]["train"]["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[:] = 65535
    tokens.tofile(shard)
    # Hugging Face directories: one with a config.json that is not JSON, one whose weights are not safetensors.
    tokenizer = step / "tokenizer.json"
    for name in ("hf_bad_json", "hf_bad_weights"):
        (root / name).mkdir()
        shutil.copy(tokenizer, root / name / "tokenizer.json")
        p[name] = root / name
    (root / "hf_bad_json" / "config.json").write_text("{not json")
    (root / "hf_bad_weights" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "eos_token_id": 0}))
    (root / "hf_bad_weights" / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    p["binary_text"] = root / "binary.txt"
    p["binary_text"].write_bytes(b"\xa3\xff" * 100)
    # A learned-position model with a 16-token context.
    learned = load_config(preset="tiny", overrides=[*overrides, "model.position=learned", "model.max_seq_len=16",
                                                    "train.seq_len=16", f"train.out_dir={root / 'learned'}"])
    Trainer(learned, quiet=True).fit(until=1)
    p["learned_ckpt"] = root / "learned"
    assert step.is_dir()
    return {k: str(v) for k, v in p.items()}


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def run_cli(argv, paths, capsys):
    argv = [a.format(**paths) for a in argv]
    code = cli.main(argv)
    return code, capsys.readouterr()


def assert_one_line_error(command, code, out, expected):
    lines = out.err.strip().splitlines()
    assert code == 2, out.err
    assert "Traceback" not in out.err
    assert len(lines) == 1, out.err
    assert lines[0].startswith(f"fivefold {command}: error: ") or lines[0].startswith("fivefold: error: "), lines[0]
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_train_rejects(argv, expected, paths, data_cache, capsys, tmp_path):
    out = [] if "--out" in argv else ["--out", str(tmp_path / "run")]
    code, captured = run_cli(["train", *BASE, "--set", f"data.cache_dir={data_cache}", *out, *argv], paths, capsys)
    assert_one_line_error("train", code, captured, expected)
    if not out:
        return
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("argv, expected", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES])
def test_generate_rejects(argv, expected, paths, capsys):
    code, captured = run_cli(["generate", *argv], paths, capsys)
    assert_one_line_error("generate", code, captured, expected)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in OTHER_CASES], ids=[c[0] for c in OTHER_CASES])
def test_other_commands_reject(argv, expected, paths, capsys):
    code, captured = run_cli(argv, paths, capsys)
    assert_one_line_error(argv[0], code, captured, expected)


def test_a_bad_input_does_not_touch_an_existing_run(paths, data_cache, capsys):
    def state():  # the lock file is rewritten by every run that takes it, and left empty
        return {p: p.stat().st_mtime_ns for p in Path(paths["run"]).rglob("*") if p.name != ".lock"}
    before = state()
    code, _ = run_cli(["train", *BASE, "--set", f"data.cache_dir={data_cache}", "--out", paths["run"],
                       "--set", "train.seq_len=16"], paths, capsys)
    assert code == 2 and state() == before


def test_debug_shows_the_traceback_of_an_anticipated_error(paths, capsys):
    code, captured = run_cli(["--debug", "generate", "--checkpoint", "{tmp}/none", "--prompt", "x"], paths, capsys)
    assert code == 2 and "Traceback" in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("fivefold generate: error: no checkpoint found")


def test_an_unexpected_exception_is_reported_as_a_bug_with_its_traceback(monkeypatch, capsys):
    from fivefold.commands import train as commands

    def broken(args):
        raise KeyError("internal")
    monkeypatch.setattr(commands, "run_compare", broken)
    code = cli.main(["compare-runs", "a", "b"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" in err and "KeyError" in err
    assert "this is a bug in fivefold: please report it" in err.strip().splitlines()[-1]


def test_serve_without_the_server_extra_says_what_to_install(paths):
    """A missing package of the [serve] extra is one line naming it and the pip command, not "a bug in
    fivefold" (checked in a fresh interpreter, where fastapi is made unimportable before fivefold loads)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None; from fivefold import cli; "
            f"sys.exit(cli.main(['serve', {str(paths['run'])!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["fivefold serve: error: fivefold serve needs fastapi, which this "
                                                "environment lacks: install the server's packages with pip install "
                                                "'fivefold[serve]'"]


def test_running_out_of_memory_is_one_line_pointing_at_the_plan(data_cache, tmp_path):
    """A micro-batch that cannot fit under a 6 GB address-space limit: the CPU allocator's error becomes
    the one-line out-of-memory message, not a traceback."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
    proc = subprocess.run([sys.executable, "-m", "fivefold", "train", *BASE, "--set", f"data.cache_dir={data_cache}",
                           "--set", "train.micro_batch_size=20000", "--set", "train.seq_len=256",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, preexec_fn=limit,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fivefold train: error: out of memory") and "fivefold plan" in line
