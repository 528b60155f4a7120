"""Which part of a sparse decode layer issues the small torch ops (CPU, no GPU needed).

The H100 profile of an engine decode step (profile_engine_step.py) lists ~65 small torch
kernels per sparse layer around the fused Triton ones, without saying who issues them. This
runs one eager decode step of a tiny engine on the CPU — with the same code path as the GPU:
the Triton kernels (TRITON_INTERPRET=1) wherever CUDA would take them — and counts, per part of the
coordinator's decode layer, the torch ops that would launch a GPU kernel (views, reshapes and
other metadata-only ops are not counted; a Triton launch counts as one).

    TRITON_INTERPRET=1 python benchmarks/count_step_ops.py --config '{"algorithm": "quest", "backend": "triton"}'

Parts: store.write_decode (the new token's K/V into the device buffer and the host queue),
algorithm.select, store.ensure_resident (swap-in), adaptor.plan (the backend's page table or
indices), backend.run (attention), the append (the algorithm's representation of the new token),
and the model's own ops (projections, norms, RoPE, MLP) outside the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any, Callable

import torch

# metadata-only ops: no kernel on a GPU
VIEWS = {
    "aten::view", "aten::reshape", "aten::expand", "aten::slice", "aten::select", "aten::as_strided",
    "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::permute", "aten::detach",
    "aten::alias", "aten::_unsafe_view", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::lift_fresh", "aten::flatten", "aten::unflatten", "aten::narrow", "aten::split", "aten::chunk",
    "aten::unbind", "aten::view_as", "aten::expand_as", "aten::result_type", "aten::resolve_conj",
    "aten::resolve_neg", "aten::contiguous", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
    "aten::to", "aten::_to_copy", "aten::type_as", "aten::dim", "aten::size", "aten::stride",
}
PARTS = ("store.write_decode", "algorithm.select", "store.ensure_resident", "adaptor.plan", "backend.run",
         "coordinator._append")


def _wrap(obj: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def _mark_triton_launches() -> None:
    """Each interpreted Triton launch in a "triton launch" range: one GPU kernel; the torch ops
    the interpreter issues inside it (copies to and from its host arrays) are not counted."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function("triton launch"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = marked  # type: ignore[method-assign]


def _force_triton() -> None:
    """Every "auto" kernel choice takes Triton, as it does on CUDA (on the CPU it takes torch)."""
    import sparse_framework.common.layout as layout

    real = layout.resolve_impl

    def triton_everywhere(impl: str, device: Any) -> str:
        return real("triton" if impl == "auto" else impl, device)

    for name, module in list(sys.modules.items()):
        if name.startswith("sparse_framework") and getattr(module, "resolve_impl", None) is real:
            module.resolve_impl = triton_everywhere  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default='{"algorithm": "quest", "backend": "triton"}', help="sparse config (JSON)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each request (default 512)")
    p.add_argument("--batch", type=int, default=2, help="requests decoding (default 2)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (the Triton kernels run interpreted on the CPU)", file=sys.stderr)
        return 2
    from sparse_framework.engine import Engine, EngineConfig, SamplingParams
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
    from sparse_framework.engine.models import ModelConfig, random_model

    _force_triton()
    _mark_triton_launches()
    config = {"top_k": 64, "page_size": 16, "device_buffer_tokens": 256, "sparse_policy": "always", "min_sparse_prompt_len": 256,
              **json.loads(args.config)}
    config.setdefault("extra", {"dense_first_layers": 0} if config.get("algorithm") == "quest" else {})
    model_config = ModelConfig.from_hf(RANDOM_MODELS["tiny"])
    model = random_model(model_config, "float32", "cpu")
    engine = Engine(model, model_config, config, EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=args.context, max_model_len=args.context + 16))
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", torch.randint(0, model_config.vocab_size, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not engine.step_log or engine.step_log[-1][1] or engine.step_log[-1][0] < args.batch:
        engine.step()
    engine.step()  # one decode step before the counted one
    coord = engine.runner.coord
    for obj, name, label in ((coord.store, "write_decode", PARTS[0]), (coord.algorithm, "select", PARTS[1]),
                             (coord.store, "ensure_resident", PARTS[2]), (coord.adaptor, "plan", PARTS[3]),
                             (coord.backend, "run", PARTS[4]), (coord, "_append", PARTS[5])):
        _wrap(obj, name, label)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("step"):
            engine.step()
    counts: Counter[str] = Counter()
    ops: dict[str, Counter[str]] = {part: Counter() for part in (*PARTS, "outside the coordinator")}
    events = prof.events()
    ranges = [e for e in events if e.name in PARTS]
    launches = [e for e in events if e.name == "triton launch"]

    def inside(e: Any, among: list[Any]) -> bool:
        return any(r.time_range.start <= e.time_range.start <= r.time_range.end for r in among)

    for e in events:
        if e.name != "triton launch" and (not e.name.startswith("aten::") or e.name in VIEWS):
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # an op inside another op: counted with it
        if e.name.startswith("aten::") and inside(e, launches):
            continue  # the interpreter's own bookkeeping
        start = e.time_range.start
        part = next((r.name for r in ranges if r.time_range.start <= start <= r.time_range.end), "outside the coordinator")
        counts[part] += 1
        ops[part][e.name] += 1
    layers = model_config.num_layers
    print(f"torch ops that launch a kernel, per decode step ({args.batch} x {args.context}, {layers} layers, "
          f"{json.loads(args.config)}):")
    for part in (*PARTS, "outside the coordinator"):
        top = ", ".join(f"{name[6:]} {n}" for name, n in ops[part].most_common(6))
        print(f"  {part:<24} {counts[part]:5d}  ({counts[part] / layers:.1f} per layer)  {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
