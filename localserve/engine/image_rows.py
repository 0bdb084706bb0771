"""An image's rows in a prompt: placeholder ids, pure Python (the scheduler reads them; the
runner decodes them from the image's embeddings: runner/images.py, runner/image_steps.py).

An id is negative, so no vocabulary has it, and packs the image's hash, whether it must be
decoded whole (its rows attend to each other both ways, as Gemma 3's do), and the row. The
same image gives the same ids, so prefix reuse and the prompt cache work on images as on text.
"""

from __future__ import annotations

ROW_BITS = 16  # rows per image < 65,536
WHOLE_BIT = 1 << ROW_BITS


def image_id(h: int, row: int, whole: bool) -> int:
    """The placeholder id of an image's row."""
    return -1 - ((h << (ROW_BITS + 1)) | (WHOLE_BIT if whole else 0) | row)


def image_row(token: int) -> tuple[int, int, bool]:
    """(hash, row, decoded whole) of a placeholder id."""
    packed = -1 - token
    return packed >> (ROW_BITS + 1), packed & (WHOLE_BIT - 1), bool(packed & WHOLE_BIT)


def chunk_length(pending: list[int], limit: int, images: bool = True) -> int:
    """How many of `pending` one step takes, at most `limit`, never ending inside an image
    that must be decoded whole: it waits for the next step, or, where it comes first and is
    longer than `limit`, goes whole (a step a few hundred rows over its budget, once). With
    `images` False, none of its images: the step starts a colleague's chat, and an image costs
    far more than its rows (llama_decode calls of its own, the encoder: runner/image_steps.py)."""
    if not images:
        limit = next((i for i, token in enumerate(pending[:limit]) if token < 0), limit)
    n = min(limit, len(pending))
    if n == len(pending) or n == 0 or pending[n] >= 0 or pending[n - 1] >= 0:
        return n
    h, row, whole = image_row(pending[n])
    if not whole or image_row(pending[n - 1])[0] != h or row == 0:
        return n
    start = n - row  # where this image's rows begin in `pending`
    if start > 0:
        return start
    end = n
    while end < len(pending) and pending[end] < 0 and image_row(pending[end])[:2] == (h, end - start):
        end += 1
    return end
