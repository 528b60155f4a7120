"""sparse-framework: pluggable decode-time sparse attention with a hierarchical KV store."""

from .common.batch import Batch, Request, Selection
from .config import SparseConfig, config_schema, load_config
from .common.errors import (
    CapacityError,
    ConfigError,
    HookOrderError,
    PluginError,
    SparseFrameworkError,
    UnsupportedFeatureError,
)
from .common.layout import KVLayout

__all__ = [
    "Batch",
    "CapacityError",
    "ConfigError",
    "HookOrderError",
    "KVLayout",
    "PluginError",
    "Request",
    "Selection",
    "SparseConfig",
    "SparseFrameworkError",
    "UnsupportedFeatureError",
    "config_schema",
    "load_config",
]
__version__ = "0.1.0"
