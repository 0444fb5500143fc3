"""A quantized model directory: safetensors + JSON (nothing is unpickled), written atomically.

Layout (`fivefold quantize ... --out DIR` writes it, `load_quantized(DIR)` reads it):
    model.safetensors     every tensor of the model, one file:
                            the parameters that are not quantized (embedding, norms, LM head unless tied,
                            biases, MoE experts) under their fivefold names, in the model's dtype (fp32);
                            each quantized linear `<module>` (e.g. layers.0.attn.q_proj) as
                            `<module>.qweight`, `<module>.scales` and, for int4 / gptq, `<module>.zeros`
                            in the format of fivefold.quant.formats (int8: int8 codes + float32 row
                            scales; int4 / gptq: two uint8 codes per byte + float16 scales and uint8
                            zero points per group).
    quantization.json     {"format": 1, "method": "int8" | "int4" | "gptq", "bits": 8 | 4,
                           "group_size": input columns per group (int4 / gptq; -1: one group per row;
                           int8: -1, one scale per output row), "modules": [the quantized modules],
                           "calibration": {how GPTQ's calibration data was chosen; {} for RTN},
                           "bytes": {"quantized": what the codes take, "expected": the formula's}}
    config.json           the fivefold config tree (fivefold.checkpoint.store.read_config reads it)
    tokenizer.json ...    the source's tokenizer files (fivefold.interop.hf.TOKENIZER_FILES), byte for byte

Shapes are not stored: the config gives every linear's (out, in), and each tensor's dtype and shape are
checked against it on load (QuantizedWeight.from_state), so a file from another model fails by name.

Everything is written into `.<DIR>.tmp-<pid>` beside DIR, fsynced and renamed into place. Replacing an
existing quantized directory moves the old one aside first and deletes it after the rename: a crash
leaves the old or the new directory complete (or, between the two renames, the old one under its
`.old-<pid>` name), never a mixture. A directory that is not a quantized model is never overwritten.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from fivefold.checkpoint.files import fsync_dir, read_json, save_tensors, write_json
from fivefold.checkpoint.kinds import QUANTIZATION, QUANTIZED_WEIGHTS, is_quantized_dir
from fivefold.checkpoint.store import read_config
from fivefold.config import Config
from fivefold.errors import CheckpointError, UserError
from fivefold.model import Transformer
from fivefold.quant.formats import BITS, METHODS, QuantizedWeight, expected_bytes
from fivefold.quant.linear import QuantLinear

FORMAT = 1
WEIGHTS, CONFIG = QUANTIZED_WEIGHTS, "config.json"


def check_out_dir(out_dir: str | Path) -> Path:
    """`out_dir`, unless it holds something save_quantized must not replace (anything but a quantized model
    or an empty directory)."""
    out = Path(out_dir)
    if out.exists() and not is_quantized_dir(out) and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not a quantized model directory; give a new --out path")
    return out


def save_quantized(out_dir: str | Path, cfg: Config, model: nn.Module, qweights: dict[str, QuantizedWeight],
                   calibration: dict | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write `model` (a plain Transformer in full precision) with the linears named in `qweights`
    ("<module>.weight" -> QuantizedWeight, from quantize_model) stored quantized. `extra_files`: {name:
    bytes}, e.g. fivefold.interop.hf.read_tokenizer_files(source)."""
    out = check_out_dir(out_dir)
    methods = {qw.method for qw in qweights.values()}
    if len(methods) != 1:
        raise ValueError(f"one method per model, got {sorted(methods)}")
    method = methods.pop()
    tensors = {n: p.detach() for n, p in model.named_parameters() if n not in qweights}
    for name, qw in qweights.items():
        tensors.update(qw.state(name.removesuffix(".weight")))
    groups = {-1 if qw.group_size == qw.shape[1] else qw.group_size for qw in qweights.values()}
    if len(groups) != 1:
        raise ValueError(f"one group size per model, got {sorted(groups)}")
    meta = {"format": FORMAT, "method": method, "bits": BITS[method],
            "group_size": groups.pop(),
            "modules": [n.removesuffix(".weight") for n in qweights], "calibration": calibration or {},
            "bytes": {"quantized": sum(qw.nbytes for qw in qweights.values()),
                      "expected": sum(expected_bytes(qw.shape, method, qw.group_size) for qw in qweights.values())}}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_tensors(tmp / WEIGHTS, tensors)
        write_json(tmp / QUANTIZATION, meta)
        write_json(tmp / CONFIG, cfg.to_dict())
        for name, data in (extra_files or {}).items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_quantization(path: str | Path) -> dict:
    meta = read_json(Path(path) / QUANTIZATION, missing_ok=False)
    if meta.get("format") != FORMAT or meta.get("method") not in METHODS:
        raise CheckpointError(f"{Path(path) / QUANTIZATION}: format {meta.get('format')!r}, method "
                              f"{meta.get('method')!r}; this fivefold reads format {FORMAT} with a method in "
                              f"{', '.join(METHODS)}")
    return meta


def load_quantized(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """(Config, Transformer) from a directory save_quantized wrote: the quantized linears as QuantLinear
    (codes as stored, computing in `dtype`), every other parameter in `dtype`, on `device`. No full-size
    weight of a quantized linear is ever made."""
    path = Path(path)
    if not is_quantized_dir(path):
        raise FileNotFoundError(f"{path} is not a quantized model directory (expected {WEIGHTS} and {QUANTIZATION})")
    meta = read_quantization(path)
    cfg = read_config(path)
    try:
        tensors = load_file(str(path / WEIGHTS), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / WEIGHTS} is not a readable safetensors file ({e})") from None
    with torch.device("meta"):
        model = Transformer(cfg.model)
    used = set()
    for name in meta["modules"]:
        try:
            linear = model.get_submodule(name)
            qw = QuantizedWeight.from_state(tensors, name, meta["method"], tuple(linear.weight.shape),
                                            meta["group_size"])
        except (AttributeError, ValueError) as e:
            raise CheckpointError(f"{path}: quantized module {name} does not fit the model of its config.json "
                                  f"({e})") from None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, QuantLinear(qw, linear.bias, dtype))  # the bias: filled below
        used.update(qw.state(name))
    params = dict(model.named_parameters())  # tied weights once, under the embedding's name
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params) - used)
    if missing or unexpected:
        raise CheckpointError(f"{path / WEIGHTS} does not match its config.json: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{path / WEIGHTS}: {name} has shape {tuple(t.shape)}, the model expects "
                                  f"{tuple(p.shape)}")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nn.Parameter(t.to(dtype), requires_grad=False))
    model.tie_weights()
    model.reset_buffers(torch.device(device))
    model.eval()
    return cfg, model


def quantized_bytes_on_disk(path: str | Path) -> tuple[int, int]:
    """(bytes of the quantized tensors as stored in model.safetensors, their expected_bytes): what
    `fivefold quantize` reports, read back from the written file."""
    path = Path(path)
    meta = read_quantization(path)
    tensors = load_file(str(path / WEIGHTS))
    suffixes = (".qweight", ".scales", ".zeros")
    stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith(suffixes)
                 and n.rpartition(".")[0] in meta["modules"])
    return stored, meta["bytes"]["expected"]


def safetensors_size(path: str | Path) -> int:
    return (Path(path) / WEIGHTS).stat().st_size


def fp32_bytes(model: nn.Module) -> int:
    return sum(4 * math.prod(p.shape) for p in model.parameters())
