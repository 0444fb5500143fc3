"""Which kind of model directory a path is, from its files alone: a fivefold checkpoint (state/ and
config.json), a quantized model (`fivefold quantize`: model.safetensors and quantization.json), or a
Hugging Face directory (config.json and safetensors); and the directory a source's weights are read from."""

from __future__ import annotations

from pathlib import Path

from fivefold.checkpoint.store import resolve_checkpoint

QUANTIZED_WEIGHTS, QUANTIZATION = "model.safetensors", "quantization.json"


def is_quantized_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / QUANTIZATION).is_file() and (path / QUANTIZED_WEIGHTS).is_file()


def is_hf_directory(src: str | Path) -> bool:
    """A Hugging Face model directory; a fivefold checkpoint has a config.json too, beside its state/, and a
    quantized model beside its quantization.json."""
    src = Path(src)
    return (src / "config.json").is_file() and not (src / "state").is_dir() and not is_quantized_dir(src)


def model_directory(source: str | Path) -> Path:
    """The directory holding the weights: a Hugging Face or quantized directory itself, or a run's (or a
    checkpoints root's) newest intact checkpoint."""
    src = Path(source)
    if is_hf_directory(src) or is_quantized_dir(src):
        return src
    return resolve_checkpoint(src)
