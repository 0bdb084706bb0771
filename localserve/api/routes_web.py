"""The built-in chat page for people who never open a terminal: GET / (and /chat) serves one
page whose assets ship inside the package (no CDN, no network at run time) under a strict
Content-Security-Policy; its conversations live server-side per key (conversations.py).
The page itself holds no data and needs no key; every API call it makes does."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from localserve.api.auth import caller
from localserve.api.schemas import OpenAIError
from localserve.api.store_threads import in_store_thread
from localserve.office.conversations import TooLarge

page_router = APIRouter()  # the page and its assets: open
api_router = APIRouter(prefix="/web/api")  # conversations: behind the key

ASSETS = {"app.js": "text/javascript", "chats.js": "text/javascript",
          "compose.js": "text/javascript", "markdown.js": "text/javascript",
          "style.css": "text/css", "icon.svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _asset(name: str) -> bytes:
    return files("localserve.web").joinpath(name).read_bytes()


@page_router.get("/", include_in_schema=False)
@page_router.get("/chat", include_in_schema=False)
async def page():
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY)


@page_router.get("/web/sign-in", include_in_schema=False)
async def sign_in(request: Request):
    """Whether the page must ask for a key before anything else: so that it never probes a
    route without one and logs a 401 in the browser before anyone could sign in."""
    return {"needs_key": request.app.state.office.keys_enabled}


@page_router.get("/web/{name}", include_in_schema=False)  # after /web/sign-in
async def asset(name: str):
    if name not in ASSETS:
        raise OpenAIError(404, f"no such asset: {name}", "not_found_error")
    return Response(_asset(name), media_type=ASSETS[name], headers=SECURITY)


@page_router.get("/favicon.ico", include_in_schema=False)
async def favicon():
    """Browsers ask for it whatever the page says: the page's icon (SVG), not a 404."""
    return Response(_asset("icon.svg"), media_type="image/svg+xml", headers=SECURITY)


class ConversationBody(BaseModel):
    title: str = Field("New chat", max_length=200)
    messages: list[dict] = Field(default_factory=list, max_length=2000)
    settings: dict = Field(default_factory=dict)


def _owner(request: Request) -> str:
    return caller(request).owner


def _store(request: Request):
    store = request.app.state.office.conversations
    if store is None:
        raise OpenAIError(404, "conversations are not kept (--no-web)", "not_found_error")
    return store


@api_router.get("/whoami")
async def whoami(request: Request):
    """The page finds its own rows in /slots by this name."""
    who = caller(request)
    return {"user": who.key, "role": who.role}


@api_router.get("/conversations")
async def list_conversations(request: Request):
    return {"data": await in_store_thread(request, _store(request).list, _owner(request))}


@api_router.get("/conversations/export")
async def export_conversations(request: Request):
    text = await in_store_thread(request, _store(request).export, _owner(request))
    return Response(text, media_type="application/json",
                    headers={"Content-Disposition": 'attachment; filename="conversations.json"'})


@api_router.get("/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request):
    found = await in_store_thread(request, _store(request).get, _owner(request), conversation_id)
    if found is None:
        raise OpenAIError(404, "no such conversation", "not_found_error")
    return found


@api_router.put("/conversations/{conversation_id}")
async def save_conversation(conversation_id: str, body: ConversationBody, request: Request):
    try:
        saved = await in_store_thread(request, _store(request).save, _owner(request),
                                      conversation_id, body.title,
                                      {"messages": body.messages, "settings": body.settings})
    except TooLarge as exc:
        raise OpenAIError(413, str(exc), code="request_too_large") from None
    return {"id": saved}


@api_router.delete("/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request):
    if not await in_store_thread(request, _store(request).delete, _owner(request), conversation_id):
        raise OpenAIError(404, "no such conversation", "not_found_error")
    return {"deleted": conversation_id}
