"""Image decoding within bounds that one key cannot stretch (hardening round 7, case 5): a
request's images together have at most MAX_REQUEST_PIXELS, counted from their headers before
their pixels are decoded; decoding runs on the image decoders' own threads, one request of a
key at a time, so a key's burst waits for its own turn and a colleague's image does not."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import png
from localserve.api import images
from localserve.api.images import ImageRef
from localserve.api.schemas import OpenAIError


def refs(count: int, size=(100, 80)) -> list[ImageRef]:
    return [ImageRef(png(size=size), f"messages[0].content[{i}]") for i in range(count)]


def test_a_requests_images_together_are_bounded_before_their_pixels_are_decoded(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(images, "MAX_REQUEST_PIXELS", 2 * 100 * 80)
    assert [i.width for i in images.decode(refs(2))] == [100, 100]
    converted, convert = [], Image.Image.convert
    monkeypatch.setattr(Image.Image, "convert",
                        lambda image, *a, **k: converted.append(image.size) or convert(image, *a, **k))
    with pytest.raises(OpenAIError) as refused:
        images.decode([*refs(2), ImageRef(png(size=(10, 10)), "messages[1].content[0]")])
    assert refused.value.status == 400 and refused.value.param == "messages[1].content[0]"
    assert "pixels together" in refused.value.message
    assert converted == [(100, 80)] * 2  # the third's pixels never decoded


def test_a_keys_requests_decode_one_at_a_time_on_the_decoders_threads(monkeypatch):
    """alice's three requests decode one after the other; bob's decodes while alice's first
    is still decoding; none on the thread pool that tokenizes chats."""
    release, running, seen = threading.Event(), {"alice": 0, "bob": 0}, []
    most = dict(running)
    lock = threading.Lock()

    def slow_decode(batch):
        who = batch[0].where
        with lock:
            running[who] += 1
            most[who] = max(most[who], running[who])
            seen.append(threading.current_thread().name)
        if who == "alice":
            release.wait(10)
        with lock:
            running[who] -= 1
        return [who]

    monkeypatch.setattr(images, "decode", slow_decode)

    async def scenario():
        alice = [asyncio.create_task(images.decode_in_turn([ImageRef("", "alice")], "alice-key"))
                 for _ in range(3)]
        bob = await asyncio.wait_for(images.decode_in_turn([ImageRef("", "bob")], "bob-key"), 5)
        assert bob == ["bob"] and not any(task.done() for task in alice)
        release.set()
        return await asyncio.gather(*alice)

    assert asyncio.run(scenario()) == [["alice"]] * 3
    assert most == {"alice": 1, "bob": 1}
    assert all(name.startswith("image-decode") for name in seen)


def test_the_image_marker_is_new_in_every_process():
    """The marker that stands for an image in a rendered chat is the server's secret: a fixed
    one could be typed by a client to place an image, or a row, where the template put text."""
    import subprocess
    import sys

    said = {subprocess.run([sys.executable, "-c", "from localserve.models.image_inputs import "
                            "IMAGE_MARKER; print(IMAGE_MARKER)"], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(said) == 2 and all(len(marker) > 20 for marker in said)
