"""The demo's synthetic long-context retrieval task: find the value of the key asked at the end.

A sequence is filler tokens with `pairs` key–value facts scattered through it (keys distinct), each
written over one aligned span of `span` tokens (the fact token repeated); its last `questions`
tokens ask for one of the keys, and the label at each of them is that key's value. A model answers
only by attending from the last position to the fact (the *needle*) far back in the context.

The demo sets `span` to the indexer's unit (QSA compressed block, Step-5 region): a fact is then one
whole unit, as a sentence spans several tokens. A one-token fact shares its unit with `unit − 1`
filler tokens; QSA's block key is the mean of the block's key rows, so such a fact's key is mostly
filler and a fresh indexer's warm-up on the demo's budget of steps leaves its recall far below 0.9
(Step-5's learned softmax pooling of a region picks the fact out, more slowly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FILLER = 32
KEYS = 8
VALUES = 8


@dataclass(frozen=True)
class RetrievalBatch:
    """input_ids, labels: int64 [batch, seq_len] (labels −100 except the question positions);
    answers: int64 [batch] the value token; needles: int64 [batch] the position of the asked fact."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    answers: torch.Tensor
    needles: torch.Tensor


class RetrievalTask:
    """Token layout: `[0, FILLER)` filler, then KEYS·VALUES fact tokens `fact(k, v)`, then KEYS
    question tokens `ask(k)`, then VALUES answer tokens `answer(v)`."""

    vocab_size = FILLER + KEYS * VALUES + KEYS + VALUES

    def __init__(
        self, seq_len: int, pairs: int = 1, seed: int = 0, questions: int = 16, span: int = 1
    ) -> None:
        if seq_len < 2 * (pairs + questions):
            raise ValueError(
                f"RetrievalTask: seq_len must be >= {2 * (pairs + questions)}; got {seq_len}"
            )
        if not 1 <= pairs <= KEYS:
            raise ValueError(f"RetrievalTask: pairs must be in [1, {KEYS}]; got {pairs}")
        if span < 1 or (seq_len - questions) // span < pairs:
            raise ValueError(
                f"RetrievalTask: span must be >= 1 with pairs spans before the questions; got {span}"
            )
        self.seq_len, self.pairs, self.questions, self.span = seq_len, pairs, questions, span
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def fact(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return FILLER + key * VALUES + value

    @staticmethod
    def ask(key: torch.Tensor) -> torch.Tensor:
        return FILLER + KEYS * VALUES + key

    @staticmethod
    def answer(value: torch.Tensor) -> torch.Tensor:
        return FILLER + KEYS * VALUES + KEYS + value

    def sample(self, batch: int) -> RetrievalBatch:
        """A fresh batch drawn from the task's generator (deterministic for a seed); `needles` are
        the first positions of the asked facts' spans."""
        g, s, n, asks = self.generator, self.seq_len, self.pairs, self.questions
        ids = torch.randint(0, FILLER, (batch, s), generator=g)
        keys = torch.rand(batch, KEYS, generator=g).argsort(dim=1)[:, :n]
        values = torch.randint(0, VALUES, (batch, n), generator=g)
        # fact spans: distinct, aligned to `span`, anywhere before the question
        slots = torch.rand(batch, (s - asks) // self.span, generator=g).argsort(dim=1)[:, :n]
        positions = slots * self.span
        for offset in range(self.span):
            ids.scatter_(1, positions + offset, self.fact(keys, values))
        asked = torch.randint(0, n, (batch,), generator=g)
        rows = torch.arange(batch)
        ids[:, -asks:] = self.ask(keys[rows, asked])[:, None]
        answers = self.answer(values[rows, asked])
        labels = torch.full_like(ids, -100)
        labels[:, -asks:] = answers[:, None]
        return RetrievalBatch(ids, labels, answers, positions[rows, asked])
