"""Dashboard: `localserve top [--url URL] [--api-key KEY]` (also `python -m tui`).

Polls /props, /slots and /metrics over HTTP in a worker that re-arms its own timer when it
finishes, so polls never overlap however slow the server is. Every string the server supplies
(model name, user names, error text) is shown as plain text, never parsed as Rich markup: a
user named "[/]" must neither crash the dashboard nor draw a fake link.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import date
from pathlib import Path
from typing import Awaitable, Callable

import httpx
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import Footer, Static

from tui.model import Tracker, View
from tui.widgets import LabeledSparkline, QueuePanel, SlotTable, SystemPanel

# fetch(model or None) -> (slots JSON, metrics text, props JSON or None); raises FetchError
Fetch = Callable[[str | None], Awaitable[tuple[dict, str, dict | None]]]
SORTS = ("id", "state", "age")
LEGEND = ("context: tokens in the slot / its size (dim: a kept prefix, reused when its "
          "conversation returns) · prefill: reading the prompt · decode: writing the answer · "
          "TTFT: time to first token over the last minute · preemptions: answers paused "
          "because the cache ran short")


class FetchError(Exception):
    pass


def http_fetcher(url: str, api_key: str | None = None, timeout: float = 3.0) -> Fetch:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    props_cache: dict = {}  # model (None: the default) -> its /props

    async def fetch(model: str | None = None):
        which = {"model": model} if model else {}
        try:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
                slots = await client.get("/slots", params={"view": "full", **which})
                if slots.status_code == 401:
                    raise FetchError("wrong or missing API key (--api-key-file, "
                                     "$LOCALSERVE_API_KEY or --api-key)")
                if slots.status_code != 200:
                    raise FetchError(f"server answered {slots.status_code} ({slots.text[:80]})")
                metrics = await client.get("/metrics")
                slots_json = slots.json()
                usage = await client.get("/v1/usage", params={  # this model's: servers may
                    "group_by": "key", "from": date.today().isoformat(),  # share one ledger
                    "model": slots_json.get("model")})
                if usage.status_code == 200:  # an admin key sees every key, a user key its own
                    slots_json["usage_today"] = usage.json()["data"]
                if model not in props_cache:
                    props = await client.get("/props", params=which)
                    if props.status_code == 200:
                        props_cache[model] = props.json()
                return slots_json, metrics.text, props_cache.get(model)
        except httpx.HTTPError as exc:
            props_cache.clear()  # the server may come back as another model
            raise FetchError(f"unreachable, retrying ({type(exc).__name__})") from exc

    return fetch


class Dashboard(App):
    CSS_PATH = "dashboard.tcss"
    TITLE = "localserve top"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause"),
        Binding("s", "cycle_sort", "sort"),
        Binding("m", "next_model", "model"),
        Binding("question_mark", "toggle_legend", "legend"),
    ]

    def __init__(self, fetch: Fetch, url: str = "", interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.fetch, self.url, self.interval, self.clock = fetch, url, interval, clock
        self.tracker = Tracker()
        self.paused = False
        self.sort_key = "id"
        self.model: str | None = None  # None: the server's default (first loaded) model
        self.view: View | None = None
        self.status = "connecting…"
        self.polls = 0

    def compose(self) -> ComposeResult:
        yield Static(id="header", markup=False)
        yield Static(id="models", markup=False, classes="hidden")  # wraps: every model shows
        yield Static(id="status", markup=False)
        yield SlotTable(id="slots")
        yield QueuePanel(id="queue")
        with Horizontal(id="charts"):
            yield LabeledSparkline("tokens/s", id="throughput")
            yield LabeledSparkline("time to first token", id="ttft")
        yield SystemPanel(id="system")
        yield Static(LEGEND, id="legend", markup=False, classes="hidden")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#header", Static).update(f"localserve · {self.url}")
        self.poll()

    @work(exclusive=True)
    async def poll(self) -> None:
        try:
            slots, metrics, props = await self.fetch(self.model)
            self.view = self.tracker.update(slots, metrics, self.clock(), props)
            self.status = "paused" if self.paused else "live"
        except FetchError as exc:
            self.status = str(exc)
        if not self.is_running:  # the app closed while the fetch was in flight
            return
        self.polls += 1
        self.render_view()
        self.set_timer(self.interval, self._rearm)

    def _rearm(self) -> None:
        if not self.paused and self.is_running:
            self.poll()

    def on_unmount(self) -> None:
        """Stop polling before the widgets go, so no update reaches a removed screen."""
        self.workers.cancel_all()

    def render_view(self) -> None:
        try:
            self._render_view()
        except NoMatches:  # the screen is being torn down (quit during a poll)
            pass

    def _render_view(self) -> None:
        status = self.query_one("#status", Static)
        live = self.status in ("live", "paused")
        status.update(f"{self.status} · sorted by {self.sort_key}" if live else self.status)
        status.set_class(not live, "error")
        view = self.view
        if view is None:
            return
        backend = f" · {view.backend}" if view.backend else ""
        header = Text.assemble((view.model, "bold"),  # the URL before the split: 80 columns
                               f" · {self.url}{backend} · {view.split.split(' (')[0]}")
        self.query_one("#header", Static).update(header)
        models = self.query_one("#models", Static)  # several: m shows the next one's slots
        models.update("models: " + ", ".join(f"{name} ({state})" for name, state in view.models))
        models.set_class(len(view.models) < 2, "hidden")
        self.query_one(SlotTable).show(self._sorted(view))
        self.query_one(QueuePanel).show(view)
        p50 = "–" if view.ttft_p50 is None else f"{view.ttft_p50:.2f}s"
        p95 = "–" if view.ttft_p95 is None else f"{view.ttft_p95:.2f}s"
        self.query_one("#throughput", LabeledSparkline).show(
            f"tokens/s {view.tok_s:.1f}", view.tok_s_history)
        self.query_one("#ttft", LabeledSparkline).show(
            f"TTFT p50 {p50}  p95 {p95}", view.ttft_p50_history)
        self.query_one(SystemPanel).show(view)

    def _sorted(self, view: View):
        if self.sort_key == "state":
            order = {"decode": 0, "prefill": 1, "idle": 2}  # preempted requests wait in the queue
            return sorted(view.slots, key=lambda r: (order.get(r.state, 9), r.id))
        if self.sort_key == "age":
            return sorted(view.slots, key=lambda r: -(r.age_s or -1))
        return sorted(view.slots, key=lambda r: r.id)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.status = "paused" if self.paused else "live"
        if not self.paused:
            self.poll()
        self.render_view()

    def action_next_model(self) -> None:
        """Show the next model's slots and numbers (a fresh tracker: rates are per model)."""
        names = [name for name, _ in self.view.models] if self.view else []
        if len(names) < 2:
            self.notify("this server has one model", timeout=1.5)
            return
        current = self.view.model if self.view.model in names else names[0]
        self.model = names[(names.index(current) + 1) % len(names)]
        self.tracker = Tracker()  # the header names the model shown from the next poll on
        self.poll()

    def action_toggle_legend(self) -> None:
        self.query_one("#legend", Static).toggle_class("hidden")

    def action_cycle_sort(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        self.notify(f"sorted by {self.sort_key}", timeout=1.5)
        self.render_view()


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="localserve top")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    parser.add_argument("--api-key", help="API key, if the server requires one (visible in ps: "
                        "prefer --api-key-file or LOCALSERVE_API_KEY)")
    parser.add_argument("--api-key-file", help="`localserve up`'s key file (name:key[:role] "
                        "lines): its first admin key, else its first key")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    return parser


def api_key(args: argparse.Namespace, environ=os.environ) -> str | None:
    """--api-key, else a key of --api-key-file (the server's own key file, read as `up` reads
    it: an admin sees every slot), else $LOCALSERVE_API_KEY: the last two keep the key out of
    the process list."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        from localserve.office.keys import read_key_file

        keys = read_key_file(Path(args.api_key_file).expanduser())  # {key: KeyHolder}
        return next((k for k, holder in keys.items() if holder.role == "admin"), next(iter(keys)))
    return environ.get("LOCALSERVE_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    Dashboard(http_fetcher(url, api_key(args)), url=url, interval=args.interval).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
