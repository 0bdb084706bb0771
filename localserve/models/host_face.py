"""The face of a model host that the HTTP side uses (as Ollama's `LlamaServer` interface is
for its runner): tokens and text, the model's special tokens, grammar checks, and a read-only
view of the cache pool and the scheduler's limits. Nothing in api/ reaches the runner or the
engine loop past it, so a change of engine shows here and nowhere else."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localserve.models.chat_template import PromptPart

if TYPE_CHECKING:
    from localserve.engine.runner.images import ImageInput
    from localserve.engine.scheduler_view import PoolLimits

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


class HostFace:
    """Mixed into ModelHost, which sets `runner` and `loop` when the model loads."""

    # ---- tokens and text ------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.runner.tokenize(text, add_special=add_special, parse_special=parse_special)

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokenize a caller's whole raw prompt (special tokens parsed), adding BOS unless the
        text already starts with it."""
        bos = self.runner.bos_text
        add_special = not (bos and text.startswith(bos))
        return self.runner.tokenize(text, add_special=add_special, parse_special=True)

    def tokenize_parts(self, parts: list[PromptPart],
                       images: list[DecodedImage] = ()) -> tuple[list[int], PlacedImages]:
        """Tokenize a rendered chat: the template's parts with special tokens parsed, callers'
        text as plain text, each IMAGE_MARKER in it as the next image's rows (placeholder ids,
        runner/images.py). BOS is added unless the template wrote it. (tokens, the images by
        hash)"""
        bos = self.runner.bos_text
        tokens: list[int] = []
        placed: PlacedImages = {}
        waiting = list(images)
        for i, part in enumerate(parts):
            add_bos = i == 0 and not (part.trusted and bos and part.text.startswith(bos))
            pieces = part.text.split(IMAGE_MARKER) if images and not part.trusted else [part.text]
            for j, text in enumerate(pieces):
                if j and not waiting:  # a template that writes a message twice
                    raise ImageError("the chat template placed an image twice; send it in a "
                                     "message the template writes once, or send text")
                if j:
                    tokens += self._image_rows(waiting.pop(0), placed)
                if text or (add_bos and j == 0):
                    tokens += self.runner.tokenize(text, add_special=add_bos and j == 0,
                                                   parse_special=part.trusted)
        if waiting:
            raise ImageError(f"{waiting[0].where}: the chat template left no place for this image")
        return tokens, placed

    def user_turns(self, tokens: list[int]) -> tuple[int, ...]:
        """Where each user message starts in a chat's tokens (llama-server's message spans:
        the template's user marker, ChatTemplate.user_start_marker, found among them): where
        sequences cannot be cut back, a prompt's chunk stops there as llama-server's batch
        does (reuse.PrefixBook.checkpoint); nothing where they can (unused there: a chat's
        whole prompt is walked for it)."""
        marker = self.user_marker
        if not marker or self.runner.cuts_back:
            return ()
        n = len(marker)
        return tuple(i for i, token in enumerate(tokens)
                     if token == marker[0] and tokens[i:i + n] == marker)

    def _image_rows(self, image: DecodedImage, placed: PlacedImages) -> list[int]:
        try:
            tokens, inputs = self.runner.projector.prepare(image.rgb, image.width, image.height,
                                                           image.raw)
        except ValueError as exc:
            raise ImageError(f"{image.where}: {exc}") from None
        for h, found in inputs.items():
            placed.setdefault(h, found)  # the same image twice: encoded once
        return tokens

    @property
    def template_source(self) -> str | None:
        """The chat template's Jinja source (None before the model is loaded)."""
        return self.template.source if self.template else None

    @property
    def reads_images(self) -> bool:
        """Whether this model was given a projector (--mmproj): images in its chats."""
        return getattr(self.runner, "projector", None) is not None

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.runner.piece(t) for t in tokens).decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        """A token's bytes as the answer spells them (control tokens: none)."""
        return self.runner.piece(token)

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary writes it (control tokens too)."""
        return self.runner.token_text(token)

    @property
    def n_vocab(self) -> int:
        return self.runner.n_vocab

    @property
    def max_piece_bytes(self) -> int:
        """The longest token's bytes: what bounds the text n tokens can spell."""
        return self.runner.max_piece_bytes

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """Fill-in-the-middle's prefix, suffix and middle tokens (None: the model has none)."""
        return self.runner.fim_tokens

    # ---- grammars ---------------------------------------------------------------------------
    def json_schema_grammar(self, schema_json: str) -> str:
        return self.runner.json_schema_grammar(schema_json)

    def grammar_error(self, gbnf: str) -> str | None:
        """llama.cpp's complaint about a grammar, or None when it parses."""
        return self.runner.grammar_error(gbnf)

    def grammar_refusal(self, user: str | None, grammar: str | None) -> str | None:
        """Why this key's grammar is refused at once (the engine lately ended it as too
        costly), else None."""
        return self.loop.scheduler.grammar_refusal(user, grammar)

    # ---- the pool -----------------------------------------------------------------------------
    def pool_view(self) -> PoolLimits:
        """The pool and the scheduler's limits, as /props and /slots show them."""
        return self.loop.scheduler.limits()

    @property
    def n_ctx_per_slot(self) -> int:
        """The most one request may use: the model's trained context, at most the pool."""
        return self.loop.scheduler.limits().n_ctx_per_slot

    @property
    def n_ctx_embedding(self) -> int:
        """The most one embedding input may hold: one slot's share of the pool."""
        return self.runner.n_ctx_embedding

    @property
    def n_embd(self) -> int:
        """The length of this model's vectors."""
        return self.runner.n_embd

    def embedder(self):
        """The model's embedder (engine/runner/embeddings.py; made on first use, blocking:
        call it on a worker thread): `embed(tokens)` gives one input's vector."""
        return self.runner.embedder(self.kind == "embedding")

    def context_bound(self) -> str:
        """What bounds one request, in the words a refusal uses (never a slot's share: a
        request borrows past it)."""
        limits, trained = self.loop.scheduler.limits(), self.runner.n_ctx_train
        if trained and limits.n_ctx_per_slot >= trained:
            return f"this model's context is {limits.n_ctx_per_slot} tokens (what it was trained on)"
        return (f"one request may use the whole cache pool, {limits.n_ctx_per_slot} tokens "
                f"(raise -c for more; the model was trained on {trained})")
