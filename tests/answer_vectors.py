"""One check for the readers of a model's own answer format (api/harmony.py, api/gemma4.py):
a canned answer from llama.cpp's tests/test-chat.cpp read whole and streamed in pieces of 1, 3
and 7 characters gives the reasoning, content and calls llama.cpp expects."""

import json


def read(reader, pieces) -> tuple[str, str, list]:
    said = []
    for piece in pieces:
        said += reader.feed(piece)
    said += reader.flush()
    thought = "".join(text for kind, text in said if kind == "thought")
    content = "".join(text for kind, text in said if kind == "text")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in reader.calls]
    return thought, content, calls


def check(make_reader, answer: str, expected: tuple) -> None:
    assert read(make_reader(), [answer]) == expected
    for size in (1, 3, 7):
        pieces = [answer[i:i + size] for i in range(0, len(answer), size)]
        assert read(make_reader(), pieces) == expected, size
