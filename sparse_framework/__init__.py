"""sparse-framework: pluggable decode-time sparse attention with a hierarchical KV store."""

from .batch import Batch, Request, Selection
from .config import SparseConfig, config_schema, load_config
from .errors import CapacityError, ConfigError, HookOrderError, PluginError, SparseFrameworkError
from .kv_store.layout import KVLayout

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
    "config_schema",
    "load_config",
]
__version__ = "0.1.0"
