"""vLLM 0.26's logprob_token_ids, offline on the trained tiny dense checkpoint: each generated position reports the
sampled token and exactly the listed ids (their model logprobs, as the whole vocabulary's), in vLLM's dict order
and ranks; rows that list ids, ask a top-N, or neither share a batch; MTP gives the same entries; the checks are
vLLM's (_validate_logprobs), in its words."""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode_mtp import mtp_llm
from tests.support.engines import share

PROMPT = "Once upon a time, the"
IDS = [355, 11, 16]  # 11 is among the greedy answer's tokens


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(trained_model_dir("dense"), dtype="float32", max_logprobs=-1, **share())


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, **kwargs})


def test_listed_ids_report_the_models_logprobs(llm: LLM) -> None:
    """The entry of a position is the sampled token first, then the listed ids with ranks 1..N (vLLM's); a listed
    id that is the sampled token keeps the first place and takes its listed rank; the values are the
    whole-vocabulary logprobs of those ids."""
    params = [greedy(logprob_token_ids=IDS), greedy(logprobs=-1)]
    listed, whole = (o.outputs[0] for o in llm.generate([PROMPT] * 2, params, use_tqdm=False))
    assert listed.token_ids == whole.token_ids and 11 in listed.token_ids
    for token, entry, full in zip(listed.token_ids, listed.logprobs, whole.logprobs, strict=True):
        assert list(entry) == [token, *(i for i in IDS if i != token)]
        # (the second prompt hits the first's cached prefix: a few ulps apart)
        assert [entry[i].logprob for i in entry] == pytest.approx([full[i].logprob for i in entry], abs=1e-5)
        assert [entry[i].rank for i in IDS] == [1, 2, 3]
        if token not in IDS:
            assert entry[token].rank == full[token].rank
    pairs = zip(listed.token_ids, listed.logprobs, strict=True)
    assert listed.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in pairs))


def test_rows_with_and_without_lists_share_a_batch(llm: LLM) -> None:
    params = [greedy(logprob_token_ids=IDS), greedy(logprobs=3), greedy(), greedy(logprob_token_ids=[7]),
              SamplingParams(temperature=1.0, seed=4, max_tokens=6, logprob_token_ids=IDS)]  # fmt: skip
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    assert all(len(e) == 1 + len(IDS) - (t in IDS) for t, e in zip(outs[0].token_ids, outs[0].logprobs, strict=True))
    assert all(len(e) in (3, 4) for e in outs[1].logprobs)  # the sampled token and the top 3
    assert outs[2].logprobs is None and outs[2].cumulative_logprob is None
    assert all(set(e) == {t, 7} for t, e in zip(outs[3].token_ids, outs[3].logprobs, strict=True))
    assert all(set(e) == {t, *IDS} for t, e in zip(outs[4].token_ids, outs[4].logprobs, strict=True))


def test_mtp_reports_the_same_entries(llm: LLM) -> None:
    (plain,) = llm.generate([PROMPT], greedy(logprob_token_ids=IDS, max_tokens=12), use_tqdm=False)
    spec, stats = mtp_llm("dense", 3, max_logprobs=-1)
    (drafted,) = spec.generate([PROMPT], greedy(logprob_token_ids=IDS, max_tokens=12), use_tqdm=False)
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    for got, want in zip(drafted.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert list(got) == list(want)
        assert [got[i].logprob for i in got] == pytest.approx([want[i].logprob for i in want], abs=1e-5)
    assert stats["verifies"] > 0


def test_checks_in_vllms_words(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    cases = {
        "Requested logprob_token_ids of length 129, which is greater than max allowed: 128 "
        "(parameter=logprob_token_ids, value=129)": greedy(logprob_token_ids=[1] * 129),
        f"token_id(s) [{vocab}] in logprob_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab} "
        f"(parameter=logprob_token_ids, value=[{vocab}])": greedy(logprob_token_ids=[1, vocab]),
        "When both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids). Got "
        "logprobs=2, len(logprob_token_ids)=3. (parameter=logprob_token_ids, value=3)": greedy(logprobs=2,
                                                                                             logprob_token_ids=IDS),
    }  # fmt: skip
    for message, params in cases.items():
        with pytest.raises(ValueError) as info:
            llm.generate([PROMPT], params, use_tqdm=False)
        assert str(info.value) == message
    assert greedy(logprob_token_ids=[]).logprob_token_ids is None  # vLLM's server passes `ids or None`
    (both,) = llm.generate([PROMPT], greedy(logprobs=3, logprob_token_ids=IDS), use_tqdm=False)
    assert all(set(e) == {t, *IDS} for t, e in zip(both.outputs[0].token_ids, both.outputs[0].logprobs, strict=True))
