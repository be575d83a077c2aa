"""End-to-end smoke of a dummy-weight checkpoint on the GPU through the offline engine (no HTTP).

Loads the model with seeded random weights, captures the decode CUDA graphs, then times: one request alone
(TTFT and per-token decode time), and a batch of concurrent requests (output tokens per second). Prints a
table and one JSON line; --out writes the JSON. Figures here are indications; claims come from bench grid.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", load_format="dummy", max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.85)  # fmt: skip
    load_s = time.perf_counter() - started
    engine = llm.engine
    rng = random.Random(0)
    record = {"model": args.model, "load_s": load_s, "gpu": torch.cuda.get_device_name(),
              "num_kv_blocks": engine.runner.layout.num_blocks, "num_state_slots": engine.runner.layout.num_slots,
              "has_cuda_graphs": engine.runner.graphs is not None, "runs": []}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(64)]}], params, use_tqdm=False)
    for concurrency in args.concurrency:
        prompts = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(args.input_len)]}
                   for _ in range(concurrency)]  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"c{concurrency}-{i}", p["prompt_token_ids"], params)
        first_token_at = None
        while engine.has_unfinished():
            outputs = engine.step()
            if first_token_at is None and outputs:
                first_token_at = time.perf_counter()
        torch.cuda.synchronize()
        total_s = time.perf_counter() - t0
        ttft = first_token_at - t0
        decode_s = total_s - ttft
        run = {"concurrency": concurrency, "total_s": total_s, "first_token_s": ttft,
               "output_tok_per_s": concurrency * args.output_len / total_s,
               "decode_ms_per_step": 1000 * decode_s / max(args.output_len - 1, 1),
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
        record["runs"].append(run)
        print(f"c={concurrency:3d}  first token {ttft * 1000:8.1f} ms  decode {run['decode_ms_per_step']:6.2f} ms/step"
              f"  output {run['output_tok_per_s']:8.1f} tok/s")  # fmt: skip
    print(json.dumps(record))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
