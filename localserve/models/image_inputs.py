"""Images in a prompt, as the HTTP side hands them to a model host (model_host.py) and the
host hands them back placed among the prompt's tokens: the marker that stands for an image in
a rendered chat, a decoded image, the error an image gets, the placed images' type."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localserve.engine.runner.images import ImageInput

# The images a prompt places among its tokens, by hash (the runner's prepared inputs, opaque
# above it): what tokenize_parts gives and a request carries to the engine (Request.images).
PlacedImages = dict[int, "ImageInput"]

# What stands for an image in a rendered chat (a caller's text, split there by tokenize_parts):
# random per process, so no text a client writes can place an image where none was sent.
IMAGE_MARKER = f"<image-{secrets.token_hex(12)}>"


@dataclass(frozen=True)
class DecodedImage:
    """An image read by the API (api/images.py): RGB pixels, the file's bytes (its identity
    in the prompt cache) and where it came from, for errors."""

    rgb: bytes
    width: int
    height: int
    raw: bytes
    where: str


class ImageError(ValueError):
    """An image the projector refused; the message names it."""
