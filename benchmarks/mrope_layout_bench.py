"""Host time of the MRoPE position block of runner/inputs.layout_step at 32 decoding image requests: the former
per-sequence loop (old) against the vectorised form now in inputs.py (new), on synthetic tables; asserts both give
the same positions. `python benchmarks/mrope_layout_bench.py` (CPU only; seconds)."""

import time

import numpy as np

B, P = 32, 1300
rng = np.random.default_rng(0)


class T:
    pass


table = T()
table.mrope = [rng.integers(0, 500, (3, P)) for _ in range(B)]
table.mrope_delta = rng.integers(-800, 0, B)
rows = np.arange(B)
starts = np.full(B, P + 50)
num_new = np.ones(B, np.int64)
query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
num_tokens = B
token_pos = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:-1], num_new)


def old():
    positions = np.broadcast_to(token_pos, (3, num_tokens)).copy()
    for i in [i for i, row in enumerate(rows) if table.mrope[row] is not None]:
        row, base, lo, n = rows[i], int(query_start_loc[i]), int(starts[i]), int(num_new[i])
        pp = table.mrope[row]
        span = np.arange(lo, lo + n)
        inp = span < pp.shape[1]
        positions[:, base : base + n] = np.where(
            inp, pp[:, np.minimum(span, pp.shape[1] - 1)], span + table.mrope_delta[row]
        )
    return positions


def new():
    positions = np.broadcast_to(token_pos, (3, num_tokens)).copy()
    mrope_seqs = [i for i, row in enumerate(rows) if table.mrope[row] is not None]
    seqs_mm = np.asarray(mrope_seqs)
    lens = np.fromiter((table.mrope[rows[i]].shape[1] for i in mrope_seqs), np.int64, len(mrope_seqs))
    is_past = starts[seqs_mm] >= lens
    past = seqs_mm[is_past]
    counts = num_new[past]
    first = np.repeat(query_start_loc[past] - (np.cumsum(counts) - counts), counts)
    tokens = first + np.arange(int(counts.sum()))
    positions[:, tokens] = token_pos[tokens] + np.repeat(table.mrope_delta[rows[past]], counts)
    return positions


assert np.array_equal(old(), new())
for f in (old, new):
    t = time.perf_counter()
    [f() for _ in range(2000)]
    print(f.__name__, f"{(time.perf_counter() - t) / 2000 * 1e6:.1f} us per step at B={B}")
