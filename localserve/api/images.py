"""Images in chats, as every API sends them, read into pixels before the model sees them.

Each API's image (OpenAI's `image_url` part, Anthropic's `image` block, Responses'
`input_image`, Ollama's `images`) becomes an ImageRef in the message: its bytes, and where it
sits in the text (IMAGE_MARKER, models/image_inputs.py). Pillow reads it with bounds on bytes, pixels
(each image's and the request's) and count, each refusal a 400 naming the image, on the image
decoders' own threads (DECODE_WORKERS), one request of a key at a time (hardening round 7, case
5): a key's burst of large images waits for its own turn there, never on the thread pool that
tokenizes colleagues' chats, and holds at most one request's pixels in the making. The
projector then resizes it
as llama.cpp does (runner/images.py). Image addresses are fetched only where the admin said so
(--image-urls: the server reaches out on a client's word), by image_fetch.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from localserve.api.key_turns import KeyTurns
from localserve.api.schemas import OpenAIError
from localserve.models.image_inputs import DecodedImage

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_PIXELS = 40_000_000  # about 8K x 5K: bigger is a decompression bomb, not a photo
MAX_SIDE = 2048  # larger images are shrunk to this first (the projector shrinks them further)
MAX_IMAGES = 16  # per request
MAX_REQUEST_PIXELS = 100_000_000  # a request's images together: about 3 s of one core's decoding
DECODE_WORKERS = 2  # threads that decode images, every key's together
_decoders = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="image-decode")
_decoding = KeyTurns(1)
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
DATA_URI = re.compile(r"^data:(image/[\w.+*-]+)?(;[^,]*)?;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class ImageRef:
    """An image as a client sent it: base64 text, and the field it came in (for errors)."""

    data: str  # base64; empty for an address to fetch, or for bytes fetched from one
    where: str
    url: str | None = None
    raw: bytes | None = None  # fetched from `url` (image_fetch.py)


def from_url(url: str, where: str, fetch: bool = False) -> ImageRef:
    """OpenAI's image_url: a data URI, or with `fetch` (--image-urls) an http(s) address."""
    match = DATA_URI.match(url)
    if match is None:
        if url.startswith(("http://", "https://")) and fetch:
            return ImageRef("", where, url)
        if url.startswith(("http://", "https://")):
            raise OpenAIError(400, f"{where}: this server does not fetch images from addresses "
                              "(its admin can allow it with --image-urls); send the image "
                              "itself as a data URI (data:image/png;base64,...)", param=where)
        raise OpenAIError(400, f"{where}: expected a data URI (data:image/png;base64,...)",
                          param=where)
    return ImageRef(url[match.end():], where)


async def decode_in_turn(refs: list[ImageRef], key: str | None) -> list[DecodedImage]:
    """decode() on the image decoders' threads, after the key's earlier requests' images."""
    if not refs:
        return []
    async with _decoding.turn(key):
        return await asyncio.get_running_loop().run_in_executor(_decoders, decode, refs)


def decode(refs: list[ImageRef]) -> list[DecodedImage]:
    """Every image as RGB pixels, or a 400 naming the first that cannot be read or that takes
    the request past MAX_REQUEST_PIXELS (counted from each image's header, before its pixels
    are decoded). Blocking (Pillow)."""
    if len(refs) > MAX_IMAGES:
        raise OpenAIError(400, f"{len(refs)} images in one request; at most {MAX_IMAGES}",
                          param=refs[MAX_IMAGES].where)
    decoded, pixels_left = [], MAX_REQUEST_PIXELS
    for ref in refs:
        image, pixels = _decode_one(ref, pixels_left)
        decoded.append(image)
        pixels_left -= pixels
    return decoded


def _decoded(ref: ImageRef) -> bytes:
    if len(ref.data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise OpenAIError(400, f"{ref.where}: the image is over {MAX_IMAGE_BYTES >> 20} MB",
                          param=ref.where)
    try:
        return base64.b64decode(ref.data, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(400, f"{ref.where}: the image is not valid base64", param=ref.where) \
            from None


def _decode_one(ref: ImageRef, pixels_left: int) -> tuple[DecodedImage, int]:
    """The image, and the pixels its file holds (what decoding it cost)."""
    from PIL import Image  # Pillow, which matplotlib brings

    if ref.url and ref.raw is None:
        raise OpenAIError(400, f"{ref.where}: the image at that address was not fetched",
                          param=ref.where)
    raw = ref.raw if ref.raw is not None else _decoded(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
            if image.width * image.height > MAX_PIXELS:
                raise OpenAIError(400, f"{ref.where}: the image is {image.width}x{image.height} "
                                  f"pixels; at most {MAX_PIXELS // 1_000_000} million",
                                  param=ref.where)
            if image.width * image.height > pixels_left:
                raise OpenAIError(400, f"{ref.where}: the request's images have more than "
                                  f"{MAX_REQUEST_PIXELS // 1_000_000} million pixels together; "
                                  f"send fewer or smaller ones", param=ref.where)
            source_pixels = image.width * image.height
            image.draft("RGB", (MAX_SIDE, MAX_SIDE))  # JPEG: decode at a smaller scale
            image = image.convert("RGB")
    except OpenAIError:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, far past ours: said the same
        raise OpenAIError(400, f"{ref.where}: the image has more pixels than the "
                          f"{MAX_PIXELS // 1_000_000} million allowed", param=ref.where) from None
    except Exception as exc:  # truncated, corrupt, or not an image Pillow reads
        kind = "an unsupported format" if "cannot identify" in str(exc) else "unreadable"
        raise OpenAIError(400, f"{ref.where}: the image is {kind} ({exc.__class__.__name__}); "
                          f"send PNG, JPEG, GIF, WebP or BMP", param=ref.where) from None
    if max(image.size) > MAX_SIDE:
        image.thumbnail((MAX_SIDE, MAX_SIDE))
    if min(image.size) < 1:
        raise OpenAIError(400, f"{ref.where}: the image has no pixels", param=ref.where)
    return DecodedImage(image.tobytes(), image.width, image.height, raw, ref.where), source_pixels
