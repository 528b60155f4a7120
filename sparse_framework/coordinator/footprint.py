"""Up-front size check: what a coordinator will allocate, against the memory there is.

The pools are sized from `max_requests`, `max_seq_len` and the capacity settings when the
coordinator is built. A size no machine holds (`max_seq_len=10**9`) used to end in the
allocator's own RuntimeError, or worse, in a slow zero-fill of memory that is then swapped or
killed. `check_footprint` estimates the bytes of every pool before anything is allocated and
raises one CapacityError that lists them and names the settings that size them.

The estimates follow the store's and the algorithms' sizing rules (the device pools' own
arithmetic in kv_store/device_pools.py; host_pool.py and fp8_host.py (the host rows' bytes), slot_maps.py,
`SparseAlgorithm.representation_bytes_per_token`); they are a
guard against sizes that cannot fit, not an exact account (`sparse-framework plan` is that).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..common.arith import cdiv
from ..common.errors import CapacityError
from ..common.layout import KVLayout
from ..config import SparseConfig, dense_layer_set
from ..kv_store.device_pools import size_device_pools
from ..kv_store.fp8_host import check_host_kv_dtype, host_bytes_per_token_per_layer
from ..kv_store.pinned import meminfo_bytes


@dataclass(frozen=True)
class Part:
    """One pool: what it is, where it lives, its bytes, and the settings that size it."""

    what: str
    device: str  # "cpu" or "cuda:N"
    bytes: int
    settings: str
    host: bool = False  # the host KV pool (on a CPU layout the device pools are on "cpu" too)


def _device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if dev.index is None else dev.index}"
    return dev.type


def available_bytes(device: str) -> int | None:
    """Memory a pool on `device` can take: free device memory on CUDA, physical memory on the
    host (a larger CPU allocation fails or swaps), None when unknown (nothing is checked)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    if device != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return meminfo_bytes("MemTotal")


def coordinator_parts(
    config: SparseConfig,
    layout: KVLayout,
    *,
    max_requests: int,
    max_seq_len: int,
    device_capacity_tokens: int | None = None,
    host_capacity_tokens: int | None = None,
) -> list[Part]:
    """The pools a SparseCoordinator with these settings allocates, largest terms only."""
    algo = config.algorithm_class
    p = config.page_size
    L = layout.num_layers
    dev = _device_name(layout.device)
    max_pages = cdiv(max_seq_len, p)
    resident = config.store == "resident"
    check_host_kv_dtype(config.host_kv_dtype, layout, resident=resident)  # refused before anything is allocated
    host_per_layer = host_bytes_per_token_per_layer(layout, config.host_kv_dtype)  # fp8 host rows: about half
    pools = size_device_pools(
        num_layers=L, dense_layers=dense_layer_set(config, layout), page_size=p,
        device_buffer_tokens=config.device_buffer_tokens, min_sparse_prompt_len=config.min_sparse_prompt_len,
        max_requests=max_requests, max_seq_len=max_seq_len, resident_only=resident,
        capacity_tokens=device_capacity_tokens, hybrid=config.store == "hybrid",
    )
    if host_capacity_tokens is None:
        host_capacity_tokens = 0 if resident else max_requests * max_pages * p
    host_tokens = cdiv(host_capacity_tokens, p) * p
    unit = p if algo.granularity == "page" else 1
    streams = layout.num_kv_heads if algo.per_kv_head else 1
    rows = "max_requests / max_seq_len"
    return [
        *(Part(f"device KV pool ({pool.kind})", dev, pool.bytes(layout), f"{rows} (or device_capacity_tokens)")
          for pool in pools),
        Part("host KV pool", "cpu", L * host_tokens * host_per_layer, f"{rows} (or host_capacity_tokens)", host=True),
        Part(
            f"algorithm {config.algorithm!r} representations", dev,
            int(algo.representation_bytes_per_token(layout, config) * L * max_requests * max_pages * p), rows,
        ),
        # l2s (int32) per unit of the sequence; page tables (int32) per page, device and host
        Part("slot maps and page tables", dev,
             4 * L * max_requests * (streams * cdiv(max_seq_len, unit) + max_pages) + 4 * max_requests * max_pages, rows),
    ]


def check_footprint(
    config: SparseConfig,
    layout: KVLayout,
    *,
    max_requests: int,
    max_seq_len: int,
    device_capacity_tokens: int | None = None,
    host_capacity_tokens: int | None = None,
) -> None:
    """CapacityError, before anything is allocated, when the pools of these settings exceed
    the memory of a device they live on; the message lists the pools and their settings."""
    parts = coordinator_parts(
        config, layout, max_requests=max_requests, max_seq_len=max_seq_len,
        device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
    )
    for device in sorted({part.device for part in parts}):
        here = [part for part in parts if part.device == device and part.bytes > 0]
        need = sum(part.bytes for part in here)
        have = available_bytes(device)
        if have is None or need <= have:
            continue
        listed = "; ".join(f"{part.what} {_gib(part.bytes)} (sized by {part.settings})" for part in here)
        where = "free on" if device.startswith("cuda") else "of memory on"
        raise CapacityError(
            f"max_requests={max_requests}, max_seq_len={max_seq_len} need {_gib(need)} on {device}, "
            f"more than the {_gib(have)} {where} {device}: {listed}. Lower max_seq_len or max_requests, "
            f"or set device_capacity_tokens / host_capacity_tokens (`sparse-framework plan` sizes them)"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


@contextlib.contextmanager
def reraise_allocation_error(what: str, settings: str) -> Iterator[None]:
    """The last resort behind `check_footprint`: an allocator failure (torch's
    OutOfMemoryError, or the CPU allocator's RuntimeError) inside the block becomes a
    CapacityError naming what was allocated and the settings that size it."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if isinstance(exc, CapacityError) or not (
            isinstance(exc, torch.OutOfMemoryError) or "alloc" in str(exc).lower()
        ):
            raise
        raise CapacityError(
            f"cannot allocate the {what}: {str(exc).splitlines()[0]}; lower {settings}"
        ) from exc
