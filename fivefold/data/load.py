"""The datasets a config trains on: pretraining windows of the embedded corpus or a prepared directory
(fivefold.data.dataset), or with data.sft, supervised fine-tuning rows (fivefold.data.sft)."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.data.dataset import Datasets, load_pretraining_datasets
from fivefold.data.sft import load_sft_datasets


def load_datasets(cfg: Config) -> Datasets:
    return load_sft_datasets(cfg) if cfg.data.sft else load_pretraining_datasets(cfg)
