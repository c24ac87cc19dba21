"""The data of the language task: English number words of 0..999 as the paper writes them, their
tokens, and the paper's train/validation/test split of the 1000 numbers."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["ONES", "TENS", "VOCAB", "TOKEN_ID", "MAX_TOKENS", "SPLIT_SIZES", "number_to_words", "encode", "make_split",
           "tokens_tensor"]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
VOCAB = ["<pad>"] + ONES + TENS[2:] + ["hundred", "and"]
TOKEN_ID = {w: i for i, w in enumerate(VOCAB)}
MAX_TOKENS = 5
SPLIT_SIZES = {"train": 169, "val": 200, "test": 631}


def number_to_words(n: int) -> str:
    """English words of ``0 <= n <= 999`` as in the paper: 515 -> "five hundred and fifteen"."""
    if not isinstance(n, (int, np.integer)) or not 0 <= n <= 999:
        raise ValueError(f"number_to_words: expected an integer in 0..999, got {n!r}")
    n = int(n)
    if n < 20:
        return ONES[n]
    if n < 100:
        t, u = divmod(n, 10)
        return TENS[t] if u == 0 else f"{TENS[t]} {ONES[u]}"
    h, rest = divmod(n, 100)
    head = f"{ONES[h]} hundred"
    return head if rest == 0 else f"{head} and {number_to_words(rest)}"


def encode(words: str) -> List[int]:
    return [TOKEN_ID[w] for w in words.split()]


def make_split(seed: int = 0) -> Dict[str, np.ndarray]:
    """The paper's split of 0..999: train 169 (0..19 plus 149 of 20..999), validation 200, test 631."""
    rng = np.random.default_rng(seed)
    rest = rng.permutation(np.arange(20, 1000))
    n_extra = SPLIT_SIZES["train"] - 20
    train = np.concatenate([np.arange(20), rest[:n_extra]])
    val = rest[n_extra:n_extra + SPLIT_SIZES["val"]]
    test = rest[n_extra + SPLIT_SIZES["val"]:]
    assert len(test) == SPLIT_SIZES["test"]
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def tokens_tensor(numbers: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """Token ids ``(N, MAX_TOKENS)`` (right-padded with 0) and the valid-token mask."""
    ids = torch.zeros(len(numbers), MAX_TOKENS, dtype=torch.long)
    for i, n in enumerate(numbers):
        t = encode(number_to_words(int(n)))
        ids[i, :len(t)] = torch.tensor(t)
    return ids, ids != 0
