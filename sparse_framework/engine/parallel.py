"""Tensor parallelism over torch.distributed: the process group, launching, and the few
collectives the engine needs.

One process per GPU (or per CPU process with gloo, for tests); every process builds its
rank's shard of the model (`random_model(config, tp=ctx.shard)` / `load_model(path,
tp=ctx.shard)`: engine/models/tensor_parallel.py) and its own `Engine` with
`EngineConfig(tensor_parallel_size=N)`, and every process is given the same requests in the
same order and calls `step()` in lockstep.

    # torchrun --nproc-per-node 2 my_script.py   (NCCL_NVLS_ENABLE=0 in the environment)
    ctx = init_tp_from_env()                      # RANK / WORLD_SIZE / LOCAL_RANK; cuda:LOCAL_RANK
    model = random_model(config, device=ctx.device, tp=ctx.shard)
    engine = Engine(model, config, sparse, EngineConfig(tensor_parallel_size=ctx.world_size))

    # or from one Python process: results of fn(ctx, *args) per rank
    results = spawn(fn, world_size=2, backend="gloo", args=(...))

How the ranks agree (docs/engine.md, "Tensor parallelism"): every rank runs its own scheduler,
identically, from the same inputs. The ranks' stores are equal in tokens (each holds the same
pages of its own KV heads), so their budgets give the same answers once the pools are the same
size: the memory plan's request rows and pool sizes are reduced with MIN across ranks at
start-up. Before each forward the ranks compare a digest of their plans (one all-gather of an
int64), so a rank whose plan differs raises on every rank rather than calling the model's
all-reduces with other shapes; after it rank 0 alone samples and broadcasts its tokens.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..common.errors import ConfigError
from .models.tensor_parallel import TPShard

# NVLink multicast (NVLS) stays off: the GPU machines' documentation requires it, in every process
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_CURRENT: TPContext | None = None


@dataclass
class TPContext:
    """This process's rank in the tensor-parallel group and the group's collectives."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: Any = None  # the process group (None: the default group)
    host_group: Any = None  # a gloo group over the same ranks for host-side checks (made when first needed)

    @property
    def shard(self) -> TPShard:
        """What the model needs: the rank, the world size and the all-reduce."""
        return TPShard(self.rank, self.world_size, reduce=self.all_reduce)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; x is returned (the model's row-parallel outputs)."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def min_ints(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of `values` over the ranks (the memory plan's rows and
        pools: admission then answers the same on every rank)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def check_same_step(self, digest: int, on_host: bool = False) -> None:
        """Raise on every rank unless every rank scheduled the same step (`digest` of its plan):
        run before the forward, since ranks with different steps would call the model's
        all-reduces with different shapes (a crash or a hang, not an error message).
        `on_host`: over the gloo side group (`host_group`), which does not wait for the device
        (with NCCL the gather would queue behind the step the GPU still runs: async scheduling)."""
        host = on_host and self.backend != "gloo"
        if host and self.host_group is None:  # made at the first use, by every rank at the same step
            self.host_group = dist.new_group(backend="gloo")
        group = self.host_group if host else self.group
        mine = torch.tensor([digest], dtype=torch.int64, device="cpu" if host else self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=group)
        digests = [int(r) for r in torch.cat(rows).tolist()]
        if len(set(digests)) != 1:
            raise RuntimeError(
                f"tensor parallelism: the ranks scheduled different steps (plan digests {digests}); every rank must get "
                "the same requests in the same order and the same EngineConfig"
            )

    def broadcast_tokens(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's `count` sampled tokens [count] int64 on every rank's device, without the
        host (async scheduling: they stay on the device and feed the next step)."""
        if self.rank == 0:
            if tokens is None or tokens.shape != (count,):
                raise RuntimeError(f"rank 0 must give the {count} sampled tokens of the step")
            row = tokens.to(torch.int64)
        else:
            row = torch.empty(count, dtype=torch.int64, device=self.device)
        dist.broadcast(row, src=0, group=self.group)
        return row

    def share_tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        """Rank 0's `count` sampled tokens, on every rank (a broadcast)."""
        row = torch.zeros(count, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            if tokens is None or len(tokens) != count:
                raise RuntimeError(f"rank 0 must give the {count} sampled tokens of the step")
            row.copy_(torch.tensor(tokens, dtype=torch.int64))
        dist.broadcast(row, src=0, group=self.group)
        return [int(v) for v in row.tolist()]


def current() -> TPContext | None:
    """The context `init_tp` made in this process (None: not initialised)."""
    return _CURRENT


def init_tp(
    rank: int, world_size: int, backend: str = "nccl", *, init_method: str | None = None,
    device: str | torch.device | None = None,
) -> TPContext:
    """Join the group as `rank` of `world_size` (init_method None: env://, MASTER_ADDR and
    MASTER_PORT). device: this rank's (None: cuda:rank % the visible GPUs with nccl, else cpu).
    With nccl, NVLink multicast is switched off unless the environment already says otherwise."""
    global _CURRENT
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"init_tp: backend must be 'nccl' (GPUs) or 'gloo' (CPU), got {backend!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"init_tp: rank must be in 0..{world_size - 1}, got {rank}")
    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        # every rank is on this host: gloo (the CPU group, or the host-side group beside NCCL)
        # on loopback, not on whatever the hostname resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size, **kwargs)
    _CURRENT = TPContext(rank, world_size, backend, dev)
    return _CURRENT


def init_tp_from_env(backend: str | None = None) -> TPContext:
    """`init_tp` from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK): the device is
    cuda:LOCAL_RANK with nccl (the default where CUDA is available), cpu with gloo."""
    try:
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except KeyError as exc:
        raise ConfigError(f"init_tp_from_env: {exc.args[0]} is not set (start the script with torchrun)") from None
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return init_tp(rank, world, backend, device=f"cuda:{local}" if backend == "nccl" else "cpu")


def destroy_tp(barrier: bool = True) -> None:
    """Leave the group (the end of a rank's work). Every rank meets at a barrier first, so no
    rank tears its communicator down while a peer still sends on it; a rank leaving on an error
    skips it (its peers may be stuck in a collective it will never join)."""
    global _CURRENT
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    _CURRENT = None


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process without the interpreter's teardown. The process-group backends keep
    background threads (gloo's and the TCP store's) whose C++ destructors, run at interpreter
    exit, can abort ("terminate called without an active exception") or hang after the work
    and its output are done; `os._exit` skips them. Flush what the rank printed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, backend: str, port: int, out_dir: str, fn: Callable[..., Any],
            args: tuple[Any, ...]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **NCCL_SAFE_ENV})
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        ctx = init_tp(rank, world_size, backend)
        try:
            result = fn(ctx, *args)
        except BaseException:
            destroy_tp(barrier=False)
            raise
        torch.save({"ok": result}, path)
        destroy_tp()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise
    exit_rank(0)


def spawn(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: tuple[Any, ...] = ()) -> list[Any]:
    """Run fn(ctx, *args) in `world_size` fresh processes, one rank each (torch.multiprocessing;
    fn must be importable, a module-level function), and return each rank's result (saved with
    torch.save). A rank's exception is re-raised here with its traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        try:
            mp.spawn(_worker, args=(world_size, backend, port, out, fn, args), nprocs=world_size, join=True)
        except Exception as exc:
            reports = {r: Path(out) / f"rank{r}.pt" for r in range(world_size)}
            lines = [f"rank {r}: " + (torch.load(p, weights_only=False).get("error") or "finished its work")
                     if p.exists() else f"rank {r}: died without a report (its stderr is above)"
                     for r, p in reports.items()]
            raise RuntimeError(f"a tensor-parallel rank failed ({type(exc).__name__}):\n" + "\n".join(lines)) from exc
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)["ok"] for r in range(world_size)]
