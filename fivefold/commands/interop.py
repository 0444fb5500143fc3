"""`fivefold import-hf` and `fivefold export-hf`: Hugging Face checkpoints in and out."""

from __future__ import annotations

import argparse

from fivefold.checkpoint.store import read_config, resolve_checkpoint, save_model
from fivefold.config import Config, ConfigError
from fivefold.finetune.lora import read_adapters
from fivefold.finetune.peft import save_adapter
from fivefold.interop.hf import TOKENIZER_FILES, export_hf, import_hf, read_tokenizer_files, with_tokenizer_config
from fivefold.memory.units import parse_bytes
from fivefold.parallel.rules import check_layout
from fivefold.weights import load_model


def parse_size(text: str) -> int:
    """argparse type: '5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 bytes (decimal and
    binary units, as transformers' save_pretrained(max_shard_size=...) reads them)."""
    try:
        return parse_bytes(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers) -> None:
    p = subparsers.add_parser("import-hf", help="convert a Hugging Face model directory to a fivefold checkpoint")
    p.add_argument("src", metavar="DIR", help="directory with config.json and model.safetensors (or shards)")
    p.add_argument("--out", required=True, help="checkpoint root to write (step_00000000 + latest)")
    p.set_defaults(func=_import)
    p = subparsers.add_parser("export-hf", help="write a fivefold checkpoint as a Hugging Face model directory")
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, checkpoints root or run dir")
    p.add_argument("--out", required=True, help="output directory (config.json + safetensors)")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2", "gpt2"],
                   help="target architecture (default: chosen from the model config)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="split weights into shards of at most this size, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the base with its adapters folded in (default: the adapters alone, "
                        "in PEFT's format)")
    p.set_defaults(func=_export)


def _import(args) -> int:
    cfg, model = import_hf(args.src)
    config = Config(model=cfg)
    if cfg.position == "learned":  # keep the default train.seq_len within the position table
        config.train.seq_len = min(config.train.seq_len, cfg.max_seq_len)
    check_layout(config)
    path = save_model(args.out, config, model, extra_files=read_tokenizer_files(args.src))
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    print(f"imported {n:,d} parameters from {args.src} -> {path}")
    copied = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if "tokenizer.json" in copied:
        print(f"copied {', '.join(copied)} into the checkpoint (fivefold generate uses its tokenizer.json)")
    else:
        print(f"note: {args.src} has no tokenizer.json; pass --tokenizer to fivefold generate")
    return 0


def _export(args) -> int:
    ckpt = resolve_checkpoint(args.checkpoint)
    cfg = read_config(ckpt)
    extra = read_tokenizer_files(ckpt)  # tokenizer.json etc., from import-hf or a trained run
    if cfg.lora.r and not args.merge:
        adapters = read_adapters(ckpt, cfg)
        out = save_adapter(adapters, cfg, args.out, base=cfg.train.init_from)
        n = sum(t.numel() for t in adapters.values())
        print(f"exported the LoRA adapter ({n:,d} parameters, r={cfg.lora.r}) to {out} in PEFT's format; its base "
              f"is {cfg.train.init_from or 'the seeded init of the run config'} (--merge writes the merged model)")
        return 0
    if args.merge and not cfg.lora.r:
        print(f"note: {ckpt} is not a LoRA run; --merge changes nothing")
    _, model = load_model(ckpt)
    extra = with_tokenizer_config(model.cfg, extra)
    out = export_hf(model, args.out, arch=args.arch, max_shard_bytes=args.max_shard_size, extra_files=extra)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {n:,d} parameters to {out}" + (f" with {', '.join(extra)}" if extra else ""))
    return 0

