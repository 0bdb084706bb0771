"""Small, reusable dashboard widgets. Each renders one part of a tui.model.View."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Sparkline, Static

from tui.model import SlotRow, View

STATE_STYLE = {"idle": "dim", "prefill": "bold yellow", "decode": "bold green"}


def context_bar(used: int, limit: int, width: int = 16, idle: bool = False) -> Text:
    """A bar of context used against the slot's limit, turning red when nearly full.
    An idle slot's bar is dim: those tokens are a kept prefix, ready for reuse."""
    share = used / limit if limit else 0.0
    filled = min(width, round(share * width))
    style = "dim" if idle else "red" if share > 0.9 else "yellow" if share > 0.7 else "green"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {used}/{limit}")
    return bar


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


class SlotTable(DataTable):
    """One row per slot: state, context bar, tokens generated, current tokens/s, age, user."""

    DEFAULT_CSS = "SlotTable { height: auto; max-height: 20; }"
    COLUMNS = ("slot", "state", "context", "generated", "tok/s", "age", "user")

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.zebra_stripes = True
        self.add_columns(*self.COLUMNS)

    def show(self, rows: list[SlotRow]) -> None:
        self.clear()
        for r in rows:
            age = f"{r.age_s:.1f}s" if r.age_s is not None else ""
            busy = r.request_id is not None
            context = context_bar(r.n_cached, r.n_ctx, idle=r.state == "idle")
            if r.n_borrowed:
                context.append(f" +{r.n_borrowed} borrowed", style="magenta")
            self.add_row(str(r.id), Text(r.state, style=STATE_STYLE.get(r.state, "")), context,
                         str(r.n_decoded) if busy else "", f"{r.tok_s:.1f}" if busy else "",
                         age, Text(r.user or ""))  # Text: a user name is never markup


class LabeledSparkline(Vertical):
    """A caption above a sparkline of about the last minute."""

    DEFAULT_CSS = """
    LabeledSparkline { height: 4; border: round $primary-darken-2; padding: 0 1; }
    LabeledSparkline > Sparkline { height: 1; }
    """

    def __init__(self, caption: str, **kwargs):
        super().__init__(**kwargs)
        self.caption = caption

    def compose(self) -> ComposeResult:
        yield Static(self.caption, classes="caption")
        yield Sparkline([])

    def show(self, caption: str, values: list[float]) -> None:
        self.query_one(".caption", Static).update(caption)
        # Textual draws data whose values are all equal (one value, or all zeros) as full bars:
        # anchor the scale at zero, and draw nothing until there is something to draw.
        self.query_one(Sparkline).data = [0.0, *values] if any(values) else []


class QueuePanel(Static):
    """Waiting queue and preemptions; flashes when a preemption just happened."""

    DEFAULT_CSS = """
    QueuePanel { height: 3; border: round $primary-darken-2; padding: 0 1; }
    QueuePanel.preempted { border: round $error; }
    """

    def show(self, view: View) -> None:
        self.set_class(view.preempted_just_now, "preempted")
        text = Text(f"waiting {view.waiting}   oldest {view.oldest_wait_s:.1f}s   preemptions ")
        text.append(str(view.preemptions), style="bold red" if view.preempted_just_now else "")
        if view.preempted_just_now:
            text.append("  ← cache short: a sequence was evicted", style="red")
        used, size, borrowed = view.pool
        if borrowed:
            text.append(f"   pool {used}/{size}, {borrowed} borrowed", style="magenta")
        if view.next_up:
            text.append("   next: ")
            for i, r in enumerate(view.next_up):
                text.append(", " if i else "")
                text.append(f"{r.get('user') or r['request_id']} {r['wait_s']:.1f}s")
                if r.get("preempted"):
                    text.append(" (preempted)", style="bold red")
        self.update(text)


class SystemPanel(Static):
    """The server machine (from its /metrics), not the machine running the dashboard."""

    DEFAULT_CSS = "SystemPanel { height: auto; border: round $primary-darken-2; padding: 0 1; }"

    def show(self, view: View) -> None:
        used = view.mem_total - view.mem_available
        text = Text(f"server CPU {view.cpu_percent:.0f}% of {view.cpu_count} cores · "  # 80 columns
                    f"RSS {human_bytes(view.rss_bytes)} · "
                    f"memory {human_bytes(used)} / {human_bytes(view.mem_total)}")
        if view.cache_hit_rate is not None:
            text.append(f"\nprompt cache: {view.cache_hit_rate:.0%} of admissions restored, "
                        f"{human_bytes(view.cache_bytes)} in RAM")
            if view.drafts_kept is not None:
                text.append(f"   drafts kept {view.drafts_kept:.0%}")
        if view.usage_today:  # from the ledger: plain Text, key names are never markup
            text.append("\ntokens today: " + ", ".join(
                f"{r['key']} {r['prompt_tokens'] + r['completion_tokens']}"
                for r in view.usage_today[:8]))
        self.update(text)
