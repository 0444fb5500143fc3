"""`fivefold quantize MODEL --method int8|int4|gptq`: quantize a model's block linears, write the quantized
directory (layout: fivefold.quant.directory) and print what it costs in bytes and in held-out perplexity.

Calibration (GPTQ): `--calib FILE` (.txt / .md / .jsonl / .parquet, as `fivefold prepare` reads them,
encoded with the model's tokenizer, each document followed by eos), or by default windows of the training
split of the data the run was trained on (its config's data section). Held-out perplexity: the validation
split of that same data; for a Hugging Face model (no fivefold data) the windows of `--calib` left over
after calibration, when there are any.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.checkpoint.kinds import is_quantized_dir
from fivefold.commands.args import positive_int
from fivefold.config import Config, ConfigError
from fivefold.data.corpus import DataError, expand_inputs, iter_documents
from fivefold.data.labels import IGNORE_INDEX
from fivefold.data.load import load_datasets
from fivefold.data.tokenizer import load_tokenizer
from fivefold.errors import UserError
from fivefold.interop.hf import read_tokenizer_files
from fivefold.model import ForwardContext, doc_ids_from_tokens
from fivefold.parallel.mesh import resolve_device
from fivefold.quant.directory import check_out_dir, quantized_bytes_on_disk, safetensors_size, save_quantized
from fivefold.quant.formats import BITS, METHODS, QuantizedWeight
from fivefold.quant.gptq import quantize_model, quantized_linears
from fivefold.quant.linear import swap_linears
from fivefold.train.loss import cross_entropy_sum
from fivefold.weights import weight_source

MICRO_BATCH = 8  # windows per forward, for calibration and evaluation


@dataclass
class Source:
    cfg: Config
    model: torch.nn.Module
    directory: Path  # the checkpoint or Hugging Face directory: its tokenizer files travel along
    hf: bool


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="quantize a model's linears to int8 / int4 (round to nearest) or "
                                               "int4 by GPTQ; print bytes and held-out perplexity")
    p.add_argument("model", metavar="MODEL", help="fivefold run directory or checkpoint, or a Hugging Face model "
                                                  "directory")
    p.add_argument("--method", required=True, choices=METHODS, help="int8: per-row absmax; int4: group-wise, "
                   "round to nearest; gptq: group-wise int4 by GPTQ (needs calibration data)")
    p.add_argument("--group-size", type=int, default=128, metavar="N",
                   help="int4 / gptq: input columns per scale and zero point; -1: one group per row (default 128)")
    p.add_argument("--calib", metavar="FILE", help="GPTQ calibration text (.txt, .md, .jsonl, .parquet); default: "
                                                   "windows of the run's training split")
    p.add_argument("--calib-samples", type=positive_int, default=128, metavar="N",
                   help="calibration windows of train.seq_len tokens (default 128)")
    p.add_argument("--eval-samples", type=positive_int, default=64, metavar="N",
                   help="held-out windows for perplexity (default 64)")
    p.add_argument("--out", metavar="DIR", help="directory to write (default: MODEL-METHOD beside MODEL)")
    p.add_argument("--compare", action="store_true",
                   help="also quantize with the other methods and print fp32 / int8 / int4 / gptq side by side "
                        "(only --method is written)")
    p.add_argument("--device", default="cpu", help="where to quantize and evaluate, e.g. cpu, cuda (default cpu)")
    p.set_defaults(func=run_quantize)


# -- inputs ---------------------------------------------------------------------------------------------------


def load_source(path: str | Path) -> Source:
    """The full-precision model (fp32) and config of a fivefold run / checkpoint or a Hugging Face dir."""
    src = Path(path)
    if is_quantized_dir(src):
        raise UserError(f"{src} is already quantized; give the full-precision model it was made from")
    if not src.exists():
        raise FileNotFoundError(f"model {str(src)!r} does not exist; give a fivefold run directory or checkpoint, "
                                f"or a Hugging Face model directory")
    source = weight_source(src)
    cfg = source.config
    if source.kind == "hf" and cfg.model.position == "learned":  # the default seq_len within the positions
        cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    return Source(cfg, source.load().eval(), source.directory, hf=source.kind == "hf")


def check_group_size(model: torch.nn.Module, method: str, group_size: int) -> None:
    """A group size every quantized linear's input width takes, or a ConfigError naming the ones it fits."""
    if method == "int8":
        return
    widths: dict[int, str] = {}
    for name, m in quantized_linears(model).items():
        widths.setdefault(m.in_features, "layers.*." + name.split(".", 2)[2])
    odd = [w for w in widths if w % 2]
    if odd:
        raise ConfigError(f"int4 packs two columns per byte, but {widths[odd[0]]} has the odd input width {odd[0]}; "
                          f"use --method int8")
    if group_size in (-1, 0):
        return
    bad = [w for w in widths if group_size < 1 or w % group_size]
    if bad:
        g = math.gcd(*widths)
        fits = [d for d in range(2, g + 1) if g % d == 0 and d >= min(8, g)]
        raise ConfigError(f"--group-size {group_size} does not divide the input width {bad[0]} of {widths[bad[0]]} "
                          f"(widths {', '.join(map(str, sorted(widths)))}); choose one of "
                          f"{', '.join(map(str, fits[-6:]))}, or -1 for one group per row")


def _windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """(n, seq_len + 1) windows sharing boundary tokens, as the training data's PackedSequences."""
    n = (len(ids) - 1) // seq_len
    t = torch.tensor(ids[:n * seq_len + 1], dtype=torch.long)
    return torch.stack([t[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)]) if n else t.new_empty(0, seq_len + 1)


def file_windows(source: Source, calib: str) -> torch.Tensor:
    """--calib FILE encoded with the model's tokenizer, cut into (n, seq_len + 1) windows in a seeded order."""
    tok_path = source.directory / "tokenizer.json"
    if not tok_path.is_file():
        raise UserError(f"{source.directory} has no tokenizer.json to encode --calib {calib} with")
    tokenizer, eos = load_tokenizer(tok_path), source.cfg.model.eos_token_id
    ids: list[int] = []
    for doc in iter_documents(expand_inputs([calib])):
        ids.extend(tokenizer.encode(doc).ids)
        ids.append(eos)
    seq_len = source.cfg.train.seq_len
    windows = _windows(ids, seq_len)
    if not len(windows):
        raise DataError(f"--calib {calib} has {len(ids)} tokens, fewer than one window of train.seq_len + 1 = "
                        f"{seq_len + 1}")
    if int(windows.max()) >= source.cfg.model.vocab_size:
        raise DataError(f"--calib {calib}: the tokenizer of {source.directory} gives ids beyond the model's vocabulary")
    return windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))]


@dataclass
class Data:
    calibration: list[torch.Tensor]  # (B, S) token batches for GPTQ
    held_out: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, labels) batches for perplexity
    calibration_info: dict
    held_out_info: str


def _batches(rows: torch.Tensor) -> list[torch.Tensor]:
    return list(rows.split(MICRO_BATCH))


def load_data(source: Source, calib: str | None, calib_samples: int, eval_samples: int) -> Data:
    """Calibration windows (--calib, or the run's training split) and held-out windows (the run's
    validation split; for a Hugging Face model the --calib windows calibration did not take)."""
    seq_len = source.cfg.train.seq_len
    if source.hf:
        if not calib:
            return Data([], [], {}, "no held-out text: a Hugging Face model has no fivefold data (give --calib)")
        windows = file_windows(source, calib)
        used, rest = windows[:calib_samples], windows[calib_samples:calib_samples + eval_samples]
        what = (f"{len(rest)} windows of --calib not used for calibration" if len(rest)
                else "no held-out text: every --calib window went to calibration")
        return Data(_batches(used[:, :-1]), [(w[:, :-1], w[:, 1:]) for w in _batches(rest)],
                    {"source": str(calib), "windows": len(used), "seq_len": seq_len, "seed": 0}, what)

    data = load_datasets(source.cfg)
    if calib:
        used = file_windows(source, calib)[:calib_samples, :-1]
        info = {"source": str(calib), "windows": len(used), "seq_len": seq_len, "seed": 0}
    else:
        idx = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))[:calib_samples].tolist()
        used = data.train.pairs(idx)[0]  # inputs (n, seq_len); fine-tuning rows too
        info = {"source": "train split", "data": source.cfg.data.dataset, "windows": len(idx), "seq_len": seq_len,
                "seed": 0}
    n = min(len(data.val), eval_samples)
    held = [data.val.pairs(range(i, min(n, i + MICRO_BATCH))) for i in range(0, n, MICRO_BATCH)]
    return Data(_batches(used), held, info, f"the first {n} validation windows of {seq_len} tokens")


# -- quality ------------------------------------------------------------------------------------------------


def _logits(model, cfg: Config, inputs: torch.Tensor) -> torch.Tensor:
    docs = doc_ids_from_tokens(inputs, cfg.model.eos_token_id) if cfg.model.document_mask else None
    return model(inputs, ForwardContext(doc_ids=docs)).float()


@torch.no_grad()
def held_out_quality(model, cfg: Config, held_out: list[tuple[torch.Tensor, torch.Tensor]],
                     qweights: dict[str, QuantizedWeight] | None = None, device="cpu") -> dict:
    """{"perplexity": exp(mean token loss, as training computes it), "kl": mean KL(full precision ||
    quantized) of the next-token distributions, per counted token} of `model` with `qweights` swapped in
    (None: full precision, KL 0). KL sees a change perplexity averages away: how far each prediction moved,
    not only whether the right token lost probability."""
    loss, kl, count = 0.0, 0.0, 0
    for inputs, labels in held_out:
        inputs, labels = inputs.to(device), labels.to(device)
        full = _logits(model, cfg, inputs)
        logits = full
        if qweights:
            with quantized(model, qweights):
                logits = _logits(model, cfg, inputs)
            counted = labels != IGNORE_INDEX
            p, q = full.log_softmax(-1)[counted], logits.log_softmax(-1)[counted]  # (N, V)
            kl += float((p.exp() * (p - q)).sum())
        loss += float(cross_entropy_sum(logits, labels))
        count += int((labels != IGNORE_INDEX).sum())
    if not count:
        return {"perplexity": float("nan"), "kl": float("nan")}
    return {"perplexity": math.exp(loss / count), "kl": kl / count}


@contextlib.contextmanager
def quantized(model: torch.nn.Module, qweights: dict[str, QuantizedWeight]):
    """`model` with the named linears swapped for QuantLinear inside the block, the originals back after it
    (no copy of the model)."""
    originals = {n.removesuffix(".weight"): model.get_submodule(n.removesuffix(".weight")) for n in qweights}
    swap_linears(model, qweights)
    try:
        yield model
    finally:
        for path, linear in originals.items():
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, linear)


def linear_bytes_fp32(model: torch.nn.Module) -> int:
    return sum(4 * m.weight.numel() for m in quantized_linears(model).values())


def quality_row(model, cfg: Config, method: str, group_size: int, data: Data, device="cpu",
                log=None) -> tuple[dict, dict[str, QuantizedWeight]]:
    """One row of the quality table: quantize `model` with `method`, measure its held-out perplexity."""
    start = time.perf_counter()
    qweights = quantize_model(model, method, group_size, data.calibration, log=log)
    seconds = time.perf_counter() - start
    group = None if method == "int8" else -1 if group_size in (-1, 0) else group_size
    return {"method": method, "bits": BITS[method], "group_size": group,
            "linear_bytes": sum(qw.nbytes for qw in qweights.values()),
            **held_out_quality(model, cfg, data.held_out, qweights, device), "seconds": seconds}, qweights


def fp32_row(model, cfg: Config, data: Data, device="cpu") -> dict:
    return {"method": "fp32", "bits": 32, "group_size": None, "linear_bytes": linear_bytes_fp32(model),
            **held_out_quality(model, cfg, data.held_out, None, device), "seconds": 0.0}


def format_table(rows: list[dict]) -> str:
    base = rows[0]["perplexity"]
    lines = [f"  {'method':8s} {'bits':>4s} {'group':>5s} {'linear bytes':>13s} {'smaller':>7s} {'val ppl':>9s} "
             f"{'vs fp32':>8s} {'KL vs fp32':>10s}"]
    for r in rows:
        delta = "-" if r is rows[0] or math.isnan(base) else f"{100 * (r['perplexity'] / base - 1):+.2f}%"
        ratio = rows[0]["linear_bytes"] / r["linear_bytes"]
        lines.append(f"  {r['method']:8s} {r['bits']:4d} {str(r['group_size'] or '-'):>5s} {r['linear_bytes']:13,d} "
                     f"{ratio:6.2f}x {r['perplexity']:9.3f} {delta:>8s} {r['kl']:10.2e}")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------------


def run_quantize(args) -> int:
    device = resolve_device(args.device, "--device")
    out = check_out_dir(args.out or str(args.model).rstrip("/") + f"-{args.method}")
    source = load_source(args.model)
    model = source.model.to(device)
    check_group_size(model, args.method, args.group_size)
    methods = [m for m in METHODS if m == args.method or args.compare]
    if "gptq" in methods and source.hf and not args.calib:
        if args.method == "gptq":
            raise UserError(f"GPTQ needs calibration text for the Hugging Face model {args.model}: give --calib FILE")
        methods.remove("gptq")
        print("note: gptq left out of the comparison: a Hugging Face model needs --calib FILE")
    data = load_data(source, args.calib, args.calib_samples, args.eval_samples)

    rows = [fp32_row(model, source.cfg, data, device)]
    for method in methods:
        row, qweights = quality_row(model, source.cfg, method, args.group_size, data, device,
                                    log=lambda line: print(line, flush=True))
        rows.append(row)
        if method == args.method:
            chosen, saved = row, qweights
    calibration = data.calibration_info if args.method == "gptq" else {}
    save_quantized(out, source.cfg, model, saved, calibration, read_tokenizer_files(source.directory))

    group = "" if args.method == "int8" else f", group {chosen['group_size']}"
    calib = (f"; calibration: {calibration['windows']} windows of {calibration['seq_len']} tokens from "
             f"{calibration['source']}" if calibration else "")
    print(f"quantized {len(saved)} linears ({args.method}{group}) in {chosen['seconds']:.1f} s{calib} -> {out}")
    stored, expected = quantized_bytes_on_disk(out)
    print(f"bytes: quantized linears {stored:,d} on disk, expected {expected:,d} "
          f"({'equal' if stored == expected else 'MISMATCH'}); fp32 {rows[0]['linear_bytes']:,d}; "
          f"{out / 'model.safetensors'} {safetensors_size(out):,d} bytes")
    print(f"held-out perplexity ({data.held_out_info}):")
    print(format_table(rows))
    return 0
