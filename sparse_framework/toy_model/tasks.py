"""Synthetic long-context retrieval tasks for the shipped reference model.

A sequence is a haystack of random filler tokens with *facts* hidden at random positions,
followed by a query section that asks for some of them:

    BOS  f f f k₁ v₁ f f … k₂ p₁ p₂ p₃ p₄ f f … k₃ v₃ f …  QUERY  k₂ p₁ p₂ p₃ p₄  k₁ v₁ …
         └──────────────── haystack (prompt) ────────────────┘        └─ query section (decoded) ─┘

- associative recall (MQAR): a fact is one key token followed by one value token;
- passkey: a fact is one key token followed by a passkey of several value tokens;
- distractors: facts that are never asked for (every sequence has more facts than queries),
  and the filler itself.

Keys, values and filler come from disjoint ranges of the vocabulary, every key and every value
token occurs at most once in a haystack, so the answer to a query is unambiguous: after a key the
model must find where that key occurred, possibly thousands of tokens back, and copy what
followed it. Decode-time sparse attention is measured exactly there: the prompt (haystack and
QUERY) is prefilled densely, the query section is decoded token by token with the true tokens
fed back (teacher forcing), and the prediction after every key and every non-final value
token is scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

PAD, BOS, QUERY = 0, 1, 2
FILLER = (16, 128)  # [start, stop) token ranges
KEYS = (128, 320)
VALUES = (320, 512)
VOCAB_SIZE = 512
NUM_KEYS = KEYS[1] - KEYS[0]
NUM_VALUES = VALUES[1] - VALUES[0]


class TaskConfig(BaseModel):
    """How one family of sequences is drawn (lengths in tokens)."""

    model_config = ConfigDict(extra="forbid")

    context: int = Field(4096, ge=64, description="total sequence length: haystack + QUERY + query section")
    pairs: int = Field(32, ge=0, le=NUM_KEYS, description="one-value facts (associative recall) in the haystack")
    passkeys: int = Field(0, ge=0, le=NUM_KEYS, description="multi-token facts (passkeys) in the haystack")
    passkey_len: int = Field(4, ge=2, le=64, description="value tokens of a passkey")
    queries: int = Field(8, ge=1, description="facts asked for in the query section (the rest are distractors)")

    @model_validator(mode="after")
    def _fits(self) -> TaskConfig:
        facts = self.pairs + self.passkeys
        if facts == 0:
            raise ValueError("a task needs at least one fact: pairs + passkeys >= 1")
        if facts > NUM_KEYS:
            raise ValueError(f"pairs + passkeys = {facts} exceeds the {NUM_KEYS} key tokens")
        values = self.pairs + self.passkeys * self.passkey_len
        if values > NUM_VALUES:
            raise ValueError(f"the facts need {values} distinct value tokens, the vocabulary has {NUM_VALUES}")
        if self.queries > facts:
            raise ValueError(f"queries ({self.queries}) must be <= pairs + passkeys ({facts})")
        if self.haystack_len(self.query_tokens) < 1 + values + facts:
            raise ValueError(f"context {self.context} is too short for {facts} facts and {self.queries} queries")
        return self

    @property
    def query_tokens(self) -> int:
        """Length of the query section (passkeys are asked first, then pairs)."""
        asked_passkeys = min(self.queries, self.passkeys)
        return asked_passkeys * (1 + self.passkey_len) + (self.queries - asked_passkeys) * 2

    def haystack_len(self, query_tokens: int) -> int:
        """Tokens before QUERY (BOS included) when the query section has `query_tokens`."""
        return self.context - 1 - query_tokens


# The named tasks of the evaluation harness (the context is set per cell).
TASKS: dict[str, dict[str, int]] = {
    "mqar": {"pairs": 48, "passkeys": 0, "queries": 16},
    "passkey": {"pairs": 24, "passkeys": 4, "passkey_len": 5, "queries": 2},
    # a long query section (192 decoded tokens): what is kept of the prompt as decoding goes
    # on matters (SnapKV's decoded_tokens rule; docs/accuracy_snapkv.md)
    "mqar-long": {"pairs": 128, "passkeys": 0, "queries": 96},
}


@dataclass
class Sequence:
    """One drawn sequence. `prompt_len` tokens are the prompt (through QUERY); in the query
    section, position p is scored when `targets[p] >= 0`: the model's prediction at p must equal
    tokens[p + 1]. `query_of[p]` numbers the query that scored position belongs to (-1: none);
    `needles[q]` are the haystack positions of query q's fact (its key and value tokens)."""

    tokens: torch.Tensor  # int64 [context]
    prompt_len: int
    targets: torch.Tensor  # int64 [context], -1 where not scored
    query_of: torch.Tensor  # int64 [context]
    needles: list[torch.Tensor] = field(default_factory=list)


def draw(config: TaskConfig, generator: torch.Generator) -> Sequence:
    """One sequence of `config`, fully determined by the generator's state."""
    facts = config.pairs + config.passkeys
    keys = torch.randperm(NUM_KEYS, generator=generator)[:facts] + KEYS[0]
    lengths = torch.tensor([1] * config.pairs + [config.passkey_len] * config.passkeys)
    values = torch.randperm(NUM_VALUES, generator=generator)[: int(lengths.sum())] + VALUES[0]
    fact_tokens = [torch.cat([keys[i : i + 1], v]) for i, v in enumerate(values.split(lengths.tolist()))]
    # passkeys are asked first (a passkey task asks for passkeys), then pairs; in random order
    passkey_ids = torch.randperm(config.passkeys, generator=generator) + config.pairs
    pair_ids = torch.randperm(config.pairs, generator=generator)
    asked = torch.cat([passkey_ids, pair_ids])[: config.queries]
    asked = asked[torch.randperm(len(asked), generator=generator)]
    query_section = torch.cat([fact_tokens[int(i)] for i in asked])

    # haystack: BOS, then filler with the facts (in random order) inserted at random gaps
    haystack_len = config.haystack_len(config.query_tokens)
    assert len(query_section) == config.query_tokens
    fact_len = int(lengths.sum()) + facts
    filler = torch.randint(*FILLER, (haystack_len - 1 - fact_len,), generator=generator)
    order = torch.randperm(facts, generator=generator)
    gaps = torch.randint(0, len(filler) + 1, (facts,), generator=generator).sort().values
    # sort key: filler token i at 2i + 1, fact j's tokens at 2·gap_j (before the filler token at
    # that gap), ties between facts broken by their order, tokens of one fact kept together
    pieces = [fact_tokens[int(j)] for j in order]
    piece_keys = torch.cat([torch.full((len(p),), 2 * int(g)) for p, g in zip(pieces, gaps)])
    all_tokens = torch.cat([torch.cat(pieces), filler])
    all_keys = torch.cat([piece_keys, 2 * torch.arange(len(filler)) + 1])
    perm = torch.sort(all_keys, stable=True).indices
    body = all_tokens[perm]
    tokens = torch.cat([torch.tensor([BOS]), body, torch.tensor([QUERY]), query_section])
    prompt_len = haystack_len + 1

    # where each fact landed: its tokens occupy consecutive positions in `body`
    where = torch.empty(len(all_tokens), dtype=torch.long)
    where[perm] = torch.arange(len(all_tokens))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor([len(p) for p in pieces]).cumsum(0)[:-1]])
    fact_start = torch.empty(facts, dtype=torch.long)
    fact_start[order] = where[starts] + 1  # + 1 for BOS

    targets = torch.full((config.context,), -1, dtype=torch.long)
    query_of = torch.full((config.context,), -1, dtype=torch.long)
    needles = []
    pos = prompt_len
    for q, i in enumerate(asked.tolist()):
        n = len(fact_tokens[i])
        # predict every value token: at the key and at each value but the last
        targets[pos : pos + n - 1] = tokens[pos + 1 : pos + n]
        query_of[pos : pos + n - 1] = q
        needles.append(torch.arange(int(fact_start[i]), int(fact_start[i]) + n))
        pos += n
    assert pos == config.context
    return Sequence(tokens, prompt_len, targets, query_of, needles)

