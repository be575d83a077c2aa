"""vLLM's repetition detection (its check_sequence_repetition): whether a sequence's output ends with a pattern of
L tokens repeated min_count times, for some L in [min_pattern_size (0: 1), max_pattern_size] whose copies fit the
output.

vLLM walks every length in Python for every token, which a request with a huge max_pattern_size turns into
O(output) a token (11 ms at 32K outputs), slowing every sequence that shares the steps. Here a few lengths (the
usual settings) take that walk; many lengths keep, per length L, the run of matches t[i] == t[i - L] that ends at
the last token, updated with one vector operation per appended token: the last L x min_count tokens repeat a
pattern of length L exactly when that run reaches L x (min_count - 1). No output makes that slower than
O(min(output, max_pattern_size)) vector work a token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltaserve.sampling_params import RepetitionDetectionParams

# up to this many lengths, walking them in Python costs less than the vector operations' fixed cost
MAX_WALKED_LENGTHS = 32


class RepetitionWatch:
    """One sequence's detector: call ends_repeating with its outputs after each appended token."""

    def __init__(self, params: RepetitionDetectionParams) -> None:
        self.params = params
        self.shortest = max(params.min_pattern_size, 1)
        self.is_walked = params.max_pattern_size - self.shortest < MAX_WALKED_LENGTHS
        self._tokens = np.empty(0, dtype=np.int64)  # the outputs seen so far
        self._runs = np.zeros(0, dtype=np.int32)  # [L - 1]: matches t[i] == t[i - L] ending at the last token
        self._size = 0

    def ends_repeating(self, outputs: Sequence[int]) -> bool:
        params, size = self.params, len(outputs)
        count = params.min_count
        longest = min(params.max_pattern_size, size // count) if count >= 2 else 0
        if self.is_walked:
            return longest >= self.shortest and _walk(outputs, range(self.shortest, longest + 1), count)
        self._follow(outputs)
        if longest < self.shortest:
            return False
        lengths = np.arange(self.shortest, longest + 1, dtype=np.int64)
        return bool((self._runs[self.shortest - 1 : longest] >= lengths * (count - 1)).any())

    def _follow(self, outputs: Sequence[int]) -> None:
        """Takes in the outputs appended since the last call, updating every length's run for each."""
        if len(outputs) < self._size:
            raise ValueError("a sequence's outputs only grow")
        for position in range(self._size, len(outputs)):
            token = outputs[position]
            if position >= len(self._tokens):
                self._tokens = np.resize(self._tokens, max(256, 2 * len(self._tokens)))
            num = min(position, self.params.max_pattern_size)  # lengths 1 .. num have a token L places back
            if num > len(self._runs):
                grown = np.zeros(min(max(256, 2 * len(self._runs)), self.params.max_pattern_size), dtype=np.int32)
                grown[: len(self._runs)] = self._runs
                self._runs = grown
            if num:
                back = self._tokens[position - num : position][::-1]  # [L - 1] = t[position - L]
                runs = self._runs[:num]
                runs += 1
                runs[back != token] = 0
            self._tokens[position] = token
        self._size = len(outputs)


def _walk(outputs: Sequence[int], lengths: range, count: int) -> bool:
    """The lengths in order, as vLLM walks them: each compares the last token of every copy first, then the copies
    whole."""
    size, last = len(outputs), outputs[-1]
    for length in lengths:
        if any(outputs[size - 1 - length * m] != last for m in range(1, count)):
            continue
        tail = outputs[size - length :]
        if all(outputs[size - length * (m + 1) : size - length * m] == tail for m in range(1, count)):
            return True
    return False
