"""Verifiable synthetic tasks with a tokenizer-free vocabulary: token ids 0-9 are digits, 10 '+', 11 '=',
12 'sort'. Prompts and answers have fixed lengths per task, so batches need no padding or masks.

* ``add``: ``a + b =`` with a, b of up to ``digits`` digits (zero-padded, most significant first);
  the answer is the ``digits + 1`` digits of the sum, least significant first (the order a carry is
  computed in). Operand lengths are drawn uniformly in [1, digits]: easy and hard problems mix, so
  the reward keeps rising as longer carries are learnt.
* ``sort``: ``sort d1 .. dn =``; the answer is the n digits in ascending order.

Reward: the fraction of answer positions that are right (dense, in [0, 1]); exact match is reported too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLUS, EQ, SORT = 10, 11, 12
NUM_TOKENS = 13


@dataclass(frozen=True)
class Task:
    name: str = "add"
    digits: int = 8

    def __post_init__(self) -> None:
        if self.name not in ("add", "sort"):
            raise ValueError(f"task must be 'add' or 'sort', got {self.name!r}")
        if not 1 <= self.digits <= 30:
            raise ValueError(f"digits must be in [1, 30], got {self.digits}")

    @property
    def prompt_len(self) -> int:
        return 2 * self.digits + 2 if self.name == "add" else self.digits + 2

    @property
    def answer_len(self) -> int:
        return self.digits + 1 if self.name == "add" else self.digits

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n problems: prompts int64 [n, prompt_len] and their answers int64 [n, answer_len]."""
        if self.name == "sort":
            d = torch.randint(0, 10, (n, self.digits), generator=gen)
            prompts = torch.cat([torch.full((n, 1), SORT), d, torch.full((n, 1), EQ)], 1)
            return prompts, d.sort(1).values
        a, b = self._operand(n, gen), self._operand(n, gen)
        prompts = torch.cat([a, torch.full((n, 1), PLUS), b, torch.full((n, 1), EQ)], 1)
        return prompts, add_digits(a, b)

    def _operand(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, digits] most significant first, each with a length drawn in [1, digits] (leading zeros)."""
        d = torch.randint(0, 10, (n, self.digits), generator=gen)
        length = torch.randint(1, self.digits + 1, (n, 1), generator=gen)
        keep = torch.arange(self.digits).unsqueeze(0) >= self.digits - length
        return d * keep

    def score(self, answers: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward fp32 [n]: fraction of right positions, exact bool [n]) of answers [n, answer_len]."""
        right = answers.to(truth.device) == truth
        return right.float().mean(1), right.all(1)


def add_digits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Digit-wise sum of a, b [n, D] (most significant first) -> [n, D + 1], least significant first."""
    carry = torch.zeros(a.shape[0], dtype=torch.long)
    out = []
    for i in range(a.shape[1] - 1, -1, -1):
        s = a[:, i] + b[:, i] + carry
        out.append(s % 10)
        carry = s // 10
    out.append(carry)
    return torch.stack(out, 1)


def render(tokens: list[int]) -> str:
    """Human-readable text of token ids ('?' for ids outside the task vocabulary)."""
    names = {PLUS: "+", EQ: "=", SORT: "sort "}
    return "".join(str(t) if 0 <= t < 10 else names.get(t, "?") for t in tokens)
