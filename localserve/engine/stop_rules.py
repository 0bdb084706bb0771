"""When a sampled token ends its answer: end-of-generation (unless `ignore_eos`), a stop
string, `max_tokens`, or the slot's context full. Pure: the scheduler ends the request."""

from __future__ import annotations

from localserve.engine.finish import FinishReason
from localserve.engine.interfaces import Vocab
from localserve.engine.request import Request


def after_token(req: Request, token: int, vocab: Vocab, n_cached: int,
                n_ctx: int) -> tuple[str, FinishReason | None, str]:
    """The token's text, why the answer ends with it (None: it goes on), and llama-server's
    stop type (eos, word, limit). The token is already in `req.output_tokens`."""
    if vocab.is_eog(token) and not req.params.ignore_eos:
        return "", FinishReason.STOP, "eos"
    text = req.detokenizer.feed(vocab.piece(token))
    if req.detokenizer.stopped:
        return text, FinishReason.STOP, "word"
    if req.num_output_tokens >= req.params.max_tokens or n_cached >= n_ctx:
        return text, FinishReason.LENGTH, "limit"
    return text, None, "none"
