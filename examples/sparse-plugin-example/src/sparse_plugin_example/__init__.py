"""An example sparse-framework plugin: the `keynorm` algorithm (key-norm top-k).

Nothing here is imported by sparse-framework until a config asks for `"algorithm": "keynorm"`;
the entry point in pyproject.toml names `sparse_plugin_example.keynorm:KeyNorm` directly.
"""

from .keynorm import KeyNorm, KeyNormOptions

__all__ = ["KeyNorm", "KeyNormOptions"]
