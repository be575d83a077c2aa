"""A scripted next-token model for beam-search tests: the logprobs the engine would report for a beam's next token,
by its last token, so the server's and the offline search's eos and ranking rules can be checked by hand.

EOS is the tokenizer's eos; SCRIPT gives the 2 * width = 4 candidates after tokens 2, 3 and 4, OTHER after anything
else; TOKENIZER decodes ids as their comma-joined numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

from deltaserve.engine.request import CompletionOutput, Logprob, RequestOutput

EOS = 9
SCRIPT = {
    2: {3: -0.1, EOS: -0.5, 4: -1.0, 5: -3.0},
    3: {6: -0.2, EOS: -0.3, 7: -2.0, 8: -2.5},
    4: {6: -0.1, 7: -0.2, EOS: -4.0, 8: -5.0},
}
OTHER = {6: -1.0, 7: -1.15, 8: -1.2, EOS: -1.3}
TOKENIZER = SimpleNamespace(eos_token_id=EOS, decode=lambda ids: ",".join(map(str, ids)))


def scripted_output(tokens: list[int], request_id: str = "r") -> RequestOutput:
    """The one-token engine output of a beam step over `tokens`: its candidates as the step's only logprobs."""
    entries = {token: Logprob(value) for token, value in SCRIPT.get(tokens[-1], OTHER).items()}
    return RequestOutput(request_id, None, tokens, [CompletionOutput(0, "", [], logprobs=[entries])], True)
