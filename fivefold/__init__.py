"""fivefold: train and serve Llama-family models, from one CPU to many GPUs, with memory you can predict."""

from fivefold.config import Config, ConfigError
from fivefold.config_load import load_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "__version__"]
