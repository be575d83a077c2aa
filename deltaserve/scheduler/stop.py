"""The token-level stop rules, applied by the scheduler as each sampled token is appended (vLLM's check_stop).

eos (unless ignore_eos) and stop_token_ids end a sequence with "stop" once it has min_tokens outputs (stop_reason
None for the tokenizer's eos, the id for another eos id or a stop token id, as vLLM's); max_tokens and
max_model_len end it with "length"; then, past min_tokens, a repetition_detection pattern ends it with "repetition"
(stop_reason "repetition_detected"), in vLLM's order. Stop strings need text, so the output processor
(detokenisation) applies them and aborts the sequence in the core.
"""

from __future__ import annotations

from deltaserve.scheduler.repetition import RepetitionWatch
from deltaserve.scheduler.sequence import Sequence

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_REPETITION = "repetition"
REPETITION_DETECTED = "repetition_detected"  # vLLM's stop_reason of a repetition stop


def check_stop(seq: Sequence, token_id: int, max_model_len: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if appending token_id (already appended) ends the sequence, else None."""
    params = seq.sampling
    num_outputs = len(seq.output_token_ids)
    if num_outputs >= params.min_tokens:
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            # vLLM: the tokenizer's eos stops with no stop_reason; generation_config's other eos ids are stop token
            # ids, whose stop_reason is the id
            primary = seq.eos_token_id
            return FINISH_STOP, None if primary is None or token_id == primary else token_id
        if token_id in params.stop_token_ids:
            return FINISH_STOP, token_id
    if num_outputs >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return FINISH_LENGTH, None
    detection = params.repetition_detection
    if detection is not None and num_outputs >= params.min_tokens:
        if seq.repetition is None:
            seq.repetition = RepetitionWatch(detection)
        if seq.repetition.ends_repeating(seq.output_token_ids):
            return FINISH_REPETITION, REPETITION_DETECTED
    return None
