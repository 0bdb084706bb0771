"""llama-server's /completion shape (routes_native.py), written from the answer's pieces
(answer.py): one object, or SSE `data:` lines without a closing [DONE]; the last carries
`stop: true`, the counts, `stop_type` and llama-server's `timings` in milliseconds.

    chunk   {"content", "stop": false, "id_slot", "tokens"?, "completion_probabilities"?}
    final   {"content", "tokens", "stop": true, "model", "tokens_predicted", "tokens_evaluated",
             "tokens_cached", "stop_type": "eos" | "word" | "limit", "timings": {...}}
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Callable

from fastapi import Request

from localserve.api.answer import (ChoiceReader, Failed, Finish, Progress, Text, read, timed,
                                   whole_answer)


class NativeReply:
    def __init__(self, model: str, body, piece: Callable[[int], bytes]):
        self.model, self.body = model, body  # body: routes_native's NativeCompletion
        self.piece = piece  # token id -> its bytes, for completion_probabilities

    async def collect(self, stream, request: Request) -> dict:
        answer = await whole_answer(stream, ChoiceReader(), request)
        return {**self._final(answer.text, answer.end), **self._probabilities(answer.logprobs)}

    async def events(self, stream):
        reader = ChoiceReader(timed=self.body.timings_per_token)
        async with aclosing(read(stream, [reader])) as pieces:
            async for _, piece in pieces:
                if isinstance(piece, Failed):
                    yield {"data": json.dumps({"error": {"message": piece.error.message,
                                                         "code": piece.error.status}})}
                    return
                if isinstance(piece, Text):
                    chunk = {"content": piece.text, "stop": False, "id_slot": -1,
                             **self._probabilities(list(piece.logprobs))}
                    if self.body.return_tokens:
                        chunk["tokens"] = list(piece.token_ids)
                    yield {"data": json.dumps({**chunk, **timed(piece)})}
                elif isinstance(piece, Finish):
                    yield {"data": json.dumps(self._final("", piece))}
                elif isinstance(piece, Progress):
                    yield {"data": json.dumps({"content": "", "stop": False, "id_slot": -1,
                                               "prompt_progress": piece.as_json()})}

    def _probabilities(self, found: list) -> dict:
        """llama-server's completion_probabilities for n_probs: each token with its top N."""
        if not self.body.n_probs:
            return {}

        def entry(token: int, logprob: float) -> dict:
            raw = self.piece(token)
            return {"id": token, "token": raw.decode("utf-8", "replace"), "bytes": list(raw),
                    "logprob": logprob}
        return {"completion_probabilities": [
            {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
            for token, logprob, top in found]}

    def _final(self, text: str, end: Finish) -> dict:
        body, usage = self.body, end.usage
        return {"content": text, "tokens": list(end.tokens) if body.return_tokens else [],
                "id_slot": -1, "stop": True, "model": self.model,
                "tokens_predicted": usage.completion, "tokens_evaluated": usage.prompt,
                "tokens_cached": usage.cached, "truncated": False, "stop_type": end.stop,
                "stopping_word": "", "prompt": body.prompt if isinstance(body.prompt, str) else "",
                "timings": end.llama_timings}
