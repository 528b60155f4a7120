"""The coordinator: the lifecycle hooks an engine calls (core.py) and what they own — a request's
lifecycle (requests.py), the hooks' order (step_order.py), the inputs they check (inputs.py), the
dense-or-sparse policy (policy.py) and its tally (dense_tally.py), per-layer attention options
(options.py), causal prefill attention (prefill.py), per-layer decode graphs (graphs.py), and what
a config costs in memory (footprint.py: one coordinator; capacity.py: how many requests fit)."""

from .core import SparseCoordinator

__all__ = ["SparseCoordinator"]
