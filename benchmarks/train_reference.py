"""Train the shipped reference model (sparse_framework/reference) on one GPU, seeded.

The model (a 3M-parameter Llama with GQA and RoPE, `reference.model.ARCHITECTURE`) learns the
synthetic retrieval tasks of `reference.tasks`: associative recall and passkeys hidden among
distractors in random filler. Training follows a length curriculum (short contexts first,
where retrieval circuits form quickly, then up to 8K); each sequence draws its own mix of
facts, passkeys and queries; the loss is on the answer tokens only. The held-out test set
(other seeds) is scored at the end with teacher forcing, which is what dense decode computes.

    python benchmarks/train_reference.py                        # about 5 minutes on an H100
    python benchmarks/train_reference.py --schedule 256:20:16 --device cpu --eval-seqs 2   # smoke run

Writes the bf16 weights (with the training record as safetensors metadata) to
sparse_framework/toy_model/weights/reference.safetensors and the log to
benchmarks/results/train_reference.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_framework.toy_model.model import ARCHITECTURE, WEIGHTS, new_reference_model, save_weights  # noqa: E402
from sparse_framework.toy_model.tasks import BOS, FILLER, QUERY, TASKS, VALUES, Sequence, TaskConfig, draw  # noqa: E402

# context:steps:batch per phase; about 64K tokens a step
DEFAULT_SCHEDULE = "256:2500:256,512:1000:128,1024:800:64,2048:800:32,4096:1200:16,8192:800:8"
TEST_SEED = 1 << 40  # held-out sequences come from generators seeded far from the training ones
TEST_CONTEXTS = (2048, 4096, 8192, 16384)


def parse_schedule(text: str) -> list[tuple[int, int, int]]:
    phases = []
    for part in text.split(","):
        try:
            context, steps, batch = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--schedule: expected context:steps:batch[,...], got {part!r}") from None
        phases.append((context, steps, batch))
    return phases


def training_task(context: int, gen: torch.Generator) -> TaskConfig:
    """A random mix of facts and queries that fits in `context` (facts fill at most half).

    Half of the sequences hide one or two long passkeys (8-32 tokens): every token of their
    answer is predicted by copying what followed the previous token, which gives the dense
    signal from which copying ("induction") heads form; associative recall uses the same heads.
    """

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if randint(0, 1):
        passkey_len, passkeys = randint(8, min(32, context // 16)), randint(1, 2)
    else:
        passkey_len, passkeys = randint(2, 6), randint(0, 4)
    room = context // 2 - 2 * passkeys * (1 + passkey_len)  # facts and their queries
    pairs = randint(1, max(1, min(96, room // 4)))
    facts = pairs + passkeys
    most = min(facts, 48)
    queries = randint(min(most, max(1, facts // 2)), most)
    return TaskConfig(context=context, pairs=pairs, passkeys=passkeys, passkey_len=passkey_len, queries=queries)


def copy_sequence(context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random segment hidden in filler, then QUERY and the segment again: every token of the
    repeat but the first is predictable only by finding where the current token (and the one
    before it) occurred and copying what followed. Dense signal for the copying ("induction")
    heads. The distance between the copies is random, so a positional shortcut does not work."""
    m = int(torch.randint(8, (context - 2) // 2 + 1, (1,), generator=gen))
    start = int(torch.randint(1, context - 2 * m, (1,), generator=gen))  # BOS at 0
    segment = torch.randint(FILLER[0], VALUES[1], (m,), generator=gen)
    tokens = torch.randint(*FILLER, (context,), generator=gen)
    tokens[0] = BOS
    tokens[start : start + m] = segment
    tokens[context - m - 1] = QUERY
    tokens[context - m :] = segment
    targets = torch.full((context,), -1, dtype=torch.long)
    targets[context - m : context - 1] = segment[1:]
    return tokens, targets


def _as_pair(s: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    return s.tokens, s.targets


class Batches(torch.utils.data.IterableDataset):
    """Training batches of one phase; batch i depends only on (seed, phase, i), so the stream is
    the same for any number of loader workers (the loader interleaves workers in order)."""

    def __init__(self, seed: int, phase: int, context: int, steps: int, batch: int, copy_fraction: float) -> None:
        self.seed, self.phase, self.context, self.steps, self.batch = seed, phase, context, steps, batch
        self.copy_fraction = copy_fraction

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        start, stride = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, self.steps, stride):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.phase * 100_003 + i)
            pairs = [
                (*copy_sequence(self.context, gen), True) if float(torch.rand((), generator=gen)) < self.copy_fraction
                else (*_as_pair(draw(training_task(self.context, gen), gen)), False)
                for _ in range(self.batch)
            ]
            yield (
                torch.stack([t for t, _, _ in pairs]), torch.stack([y for _, y, _ in pairs]),
                torch.tensor([c for _, _, c in pairs]),
            )


def answer_loss(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy on the scored positions, and which of them the argmax gets right [B, n]."""
    hidden = model.model(input_ids=tokens).last_hidden_state
    mask = targets >= 0
    logits = model.lm_head(hidden[mask]).float()
    gold = targets[mask]
    right = torch.zeros_like(mask)
    right[mask] = logits.argmax(-1) == gold
    return F.cross_entropy(logits, gold), right


@torch.no_grad()
def test_accuracy(model: Any, task: str, context: int, seqs: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Teacher-forced accuracy on held-out sequences: per answer token and per query (every
    token of the answer right)."""
    cfg = TaskConfig(context=context, **TASKS[task])
    gen = torch.Generator().manual_seed(TEST_SEED + context)
    right_tokens = tokens_total = right_queries = queries_total = 0
    for _ in range(seqs):
        s = draw(cfg, gen)
        with torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=s.tokens[None].to(device)).logits[0].float()
        mask = (s.targets >= 0).to(device)
        ok = logits.argmax(-1)[mask] == s.targets.to(device)[mask]
        q = s.query_of.to(device)[mask]
        wrong_per_query = torch.zeros(int(q.max()) + 1, device=device).index_add_(0, q, (~ok).float())
        right_tokens += int(ok.sum())
        tokens_total += int(ok.numel())
        right_queries += int((wrong_per_query == 0).sum())
        queries_total += len(wrong_per_query)
    return {"token_accuracy": right_tokens / tokens_total, "query_accuracy": right_queries / queries_total}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=f"context:steps:batch per phase (default {DEFAULT_SCHEDULE})")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warm-up then cosine to 10%%)")
    p.add_argument("--copy-fraction", type=float, default=0.5, help="share of copy sequences (the rest: retrieval tasks)")
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=12, help="data-loader processes drawing sequences")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--time-limit", type=float, default=540, help="stop training after this many seconds (recorded)")
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences per task and context")
    p.add_argument("--out", type=Path, default=WEIGHTS)
    p.add_argument("--log", type=Path, default=ROOT / "benchmarks/results/train_reference.json")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = args.device
    amp = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = new_reference_model().to(device)
    params = sum(p.numel() for p in model.parameters())
    step_fn = torch.compile(answer_loss) if args.compile else answer_loss
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=torch.device(device).type == "cuda",
    )
    phases = parse_schedule(args.schedule)
    total = sum(steps for _, steps, _ in phases)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, total - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    print(f"reference model: {params:,} parameters; {total} steps in {len(phases)} phases on {device}", flush=True)
    log: list[dict[str, Any]] = []
    step, start = 0, time.perf_counter()
    model.train()
    for phase, (context, steps, batch) in enumerate(phases):
        loader = torch.utils.data.DataLoader(
            Batches(args.seed, phase, context, steps, batch, args.copy_fraction), batch_size=None,
            num_workers=args.workers, pin_memory=device != "cpu", prefetch_factor=4 if args.workers else None,
        )
        tally = torch.zeros(6, device=device)  # loss sum, steps, right, scored (copy), (retrieval)
        for tokens, targets, is_copy in loader:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            tokens = tokens.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device_type=torch.device(device).type, dtype=amp, enabled=amp != torch.float32):
                loss, right = step_fn(model, tokens, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            is_copy = is_copy.to(device)[:, None]
            scored = targets >= 0
            tally += torch.stack([
                loss.detach(), torch.ones((), device=device),
                (right & is_copy).sum(), (scored & is_copy).sum(), (right & ~is_copy).sum(), (scored & ~is_copy).sum(),
            ]).float()
            step += 1
            out_of_time = time.perf_counter() - start > args.time_limit
            if step % 100 == 0 or step == total or out_of_time:
                loss_sum, k, rc, nc, rr, nr = tally.tolist()
                entry = {
                    "step": step, "context": context, "seconds": round(time.perf_counter() - start, 1),
                    "loss": loss_sum / k, "copy_accuracy": rc / max(1, nc), "retrieval_accuracy": rr / max(1, nr),
                }
                log.append(entry)
                print(json.dumps(entry), flush=True)
                tally.zero_()
            if out_of_time:
                break
        if out_of_time:
            print(f"stopped at step {step} of {total}: --time-limit {args.time_limit} s reached", flush=True)
            break
    train_seconds = time.perf_counter() - start

    model.eval()
    test: dict[str, dict[str, dict[str, float]]] = {}
    for task in TASKS:
        test[task] = {}
        for context in TEST_CONTEXTS:
            test[task][str(context)] = test_accuracy(model, task, context, args.eval_seqs, device, amp)
            print(task, context, test[task][str(context)], flush=True)
    record = {
        "seed": args.seed, "schedule": args.schedule, "lr": args.lr, "warmup": args.warmup, "steps": total,
        "steps_done": step, "parameters": params, "train_seconds": round(train_seconds, 1), "device": _device_name(device),
        "torch": torch.__version__, "test_accuracy_teacher_forced": test, "test_seqs": args.eval_seqs,
        "architecture": ARCHITECTURE, "command": "python benchmarks/train_reference.py " + " ".join(argv or sys.argv[1:]),
    }
    save_weights(model, args.out, record)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text(json.dumps({**record, "log": log}, indent=1) + "\n")
    print(f"trained in {train_seconds:.0f} s; weights {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


if __name__ == "__main__":
    main()
