"""Pure tests of an image's placeholder ids: what the scheduler and the drafter do with them."""

from __future__ import annotations

from localserve.engine.drafts import continued
from localserve.engine.image_rows import chunk_length, image_id, image_row


def image(h: int, n: int, whole: bool) -> list[int]:
    return [image_id(h, row, whole) for row in range(n)]


def test_ids_are_negative_and_give_back_their_parts():
    for h, row, whole in ((0, 0, False), (2**48 - 1, 65535, True), (12345, 7, True)):
        token = image_id(h, row, whole)
        assert token < 0 and image_row(token) == (h, row, whole)


def test_a_causal_image_is_cut_where_the_budget_ends():
    pending = [1, 2, *image(9, 10, whole=False), 3]
    assert chunk_length(pending, 6) == 6


def test_an_image_decoded_whole_waits_for_the_next_step_rather_than_split():
    pending = [1, 2, *image(9, 10, whole=True), 3]
    assert chunk_length(pending, 6) == 2  # the text before it now, the image next step
    assert chunk_length(pending, 12) == 12  # it fits: to its end
    assert chunk_length(pending, 13) == 13


def test_an_image_decoded_whole_that_starts_the_chunk_goes_whole_past_the_budget():
    pending = [*image(9, 10, whole=True), 3, 4]
    assert chunk_length(pending, 4) == 10


def test_two_images_back_to_back_are_each_kept_whole():
    pending = [*image(1, 4, whole=True), *image(2, 4, whole=True)]
    assert chunk_length(pending, 6) == 4
    assert chunk_length(pending[4:], 2) == 4


def test_a_draft_stops_before_an_image_row():
    tokens = [5, 6, *image(3, 4, whole=False), 7, 5, 6]
    assert continued(tokens, 2, 5) == []
    assert continued([5, 6, 8, *image(3, 2, whole=False), 5, 6], 2, 4) == [8]


def test_a_step_that_starts_a_colleagues_chat_takes_none_of_the_images():
    pending = [1, 2, *image(9, 10, whole=False), 3]
    assert chunk_length(pending, 6, images=False) == 2  # the text before it only
    assert chunk_length(pending[2:], 6, images=False) == 0  # the image waits a step
    assert chunk_length([1, 2, 3], 6, images=False) == 3
