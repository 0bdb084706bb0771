"""The dashboard: snapshots of fixed payloads, and a pilot against the real server under load."""

import asyncio
import threading
import time

from test_tui_model import METRICS, slots
from tui.app import Dashboard, FetchError, http_fetcher

PROPS = {"backend": {"name": "cpu", "gpu_offload": False}, "model": {"n_layers": 30}}


def scripted(payloads):
    """A fetch that replays fixed payloads (then repeats the last), and a clock that ticks 2 s."""
    state = {"i": 0, "t": 0.0}

    async def fetch(model=None):
        item = payloads[min(state["i"], len(payloads) - 1)]
        state["i"] += 1
        if isinstance(item, Exception):
            raise item
        return item

    def clock():
        state["t"] += 2.0
        return state["t"]

    return fetch, clock


def busy_dashboard(extra=()):
    fetch, clock = scripted([
        (slots(10), METRICS.format(gen=100, b1=0, b2=0), PROPS),
        (slots(30, preemptions=1), METRICS.format(gen=160, b1=3, b2=4), PROPS),
        *extra,
    ])
    return Dashboard(fetch, url="http://office-server:8080", interval=3600, clock=clock)


async def poll_done(pilot):
    """Wait for the running poll worker to finish and its render to land (no fixed sleep)."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def poll_twice(pilot):
    await poll_done(pilot)  # the poll started at mount
    pilot.app.poll()
    await poll_done(pilot)


def test_snapshot_busy_server_with_a_preemption(snap_compare):
    assert snap_compare(busy_dashboard(), terminal_size=(100, 26), run_before=poll_twice)


def test_snapshot_unreachable_server_keeps_the_last_view(snap_compare):
    app = busy_dashboard(extra=[FetchError("unreachable, retrying (ConnectError)")])

    async def three_polls(pilot):
        await poll_twice(pilot)
        pilot.app.poll()
        await poll_done(pilot)

    assert snap_compare(app, terminal_size=(100, 26), run_before=three_polls)


def test_keys_pause_sort_and_resize():
    async def run():
        app = busy_dashboard()
        async with app.run_test(size=(100, 26)) as pilot:
            await poll_twice(pilot)
            await pilot.press("s")
            assert app.sort_key == "state"
            await pilot.press("p")
            assert app.paused and app.status == "paused"
            await pilot.resize_terminal(50, 14)
            await pilot.pause()  # one message-queue turn, not a sleep
            assert app.query_one("#slots").row_count == 2
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(run())


def test_pilot_against_the_real_server_sees_slots_busy_then_idle(server, client):
    load = [threading.Thread(target=lambda i=i: client.completions.create(
        model="default", prompt=f"Story number {i}:", max_tokens=60,
        extra_body={"ignore_eos": True})) for i in range(3)]

    async def run():
        app = Dashboard(http_fetcher(server.url), url=server.url, interval=0.2)
        async with app.run_test(size=(110, 30)) as pilot:
            for t in load:
                t.start()
            busy_seen, deadline = 0, time.monotonic() + 300  # a busy machine's pace too
            while time.monotonic() < deadline:
                await pilot.pause(0.1)
                if app.view and sum(r.state != "idle" for r in app.view.slots) >= 2:
                    busy_seen += 1
                if busy_seen and not any(t.is_alive() for t in load):
                    break
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await pilot.pause(0.1)
                if app.view and all(r.state == "idle" for r in app.view.slots):
                    break
            assert busy_seen > 0
            assert all(r.state == "idle" for r in app.view.slots)
            assert app.status == "live" and "SmolLM2" in app.view.model
            assert app.view.backend.startswith("cpu")

    asyncio.run(run())
    for t in load:
        t.join()


def test_unreachable_server_is_reported_not_fatal():
    async def run():
        app = Dashboard(http_fetcher("http://127.0.0.1:9"), url="http://127.0.0.1:9", interval=0.1)
        async with app.run_test(size=(80, 20)) as pilot:
            for _ in range(30):
                await pilot.pause(0.1)
                if app.polls >= 2:
                    break
            assert app.polls >= 2 and app.status.startswith("unreachable, retrying")

    asyncio.run(run())


def test_server_strings_are_shown_as_plain_text_never_markup():
    """A user named "[/]" (possible without keys: the `user` field) once killed the dashboard."""
    hostile = slots(10)
    hostile["model"] = "[link=https://evil.example]click[/link]"
    hostile["slots"][0]["user"] = "[/]"
    hostile["queue"]["requests"][0]["user"] = "[bold red]admin[/]"
    fetch, clock = scripted([(hostile, METRICS.format(gen=100, b1=0, b2=0), PROPS),
                             FetchError("server answered 500 ([/] [b]x)")])

    async def run():
        app = Dashboard(fetch, url="http://office-server:8080", interval=3600, clock=clock)
        async with app.run_test(size=(110, 26)) as pilot:
            await poll_done(pilot)
            table = app.query_one("#slots")
            assert "[/]" in [str(cell) for cell in table.get_row_at(0)]
            header = app.query_one("#header").render()
            assert "[link=https://evil.example]click[/link]" in str(header)
            assert "[bold red]admin[/]" in str(app.query_one("#queue").render())
            app.poll()
            await poll_done(pilot)
            assert "([/] [b]x)" in str(app.query_one("#status").render())

    asyncio.run(run())


def test_admins_see_todays_tokens_per_key_from_the_ledger():
    payload = slots(10)
    payload["usage_today"] = [{"key": "alice", "prompt_tokens": 100, "completion_tokens": 20},
                              {"key": "[bob]", "prompt_tokens": 5, "completion_tokens": 5}]
    fetch, clock = scripted([(payload, METRICS.format(gen=100, b1=0, b2=0), PROPS)])

    async def run():
        app = Dashboard(fetch, url="http://office-server:8080", interval=3600, clock=clock)
        async with app.run_test(size=(110, 30)) as pilot:
            await poll_done(pilot)
            assert "tokens today: alice 120, [bob] 10" in str(app.query_one("#system").render())

    asyncio.run(run())


def two_model_payload(model, generated):
    shown = model or "a"
    payload = slots(generated // 10)
    payload["model"] = shown
    payload["models"] = [{"id": "a", "status": {"value": "loaded"}},
                         {"id": "b", "status": {"value": "loaded"}}]
    metrics = "".join(
        f'# TYPE localserve:{name} {kind}\n' + "".join(
            f'localserve:{name}{suffix}{{model="{m}"}} {value * (3 if m == "b" else 1)}\n'
            for m in ("a", "b"))
        for name, kind, suffix, value in (
            ("generation_tokens", "counter", "_total", generated),
            ("process_cpu_percent", "gauge", "", 95), ("system_cpu_count", "gauge", "", 2),
            ("process_resident_memory_bytes", "gauge", "", 300e6),
            ("system_memory_total_bytes", "gauge", "", 8e9)))
    return payload, metrics, PROPS


def two_model_dashboard():
    """A server with models a and b: 100 more tokens per poll for a, 300 for b, 2 s apart."""
    polls = {"n": 0}

    async def fetch(model=None):
        polls["n"] += 1
        return two_model_payload(model, 100 * polls["n"])

    ticks = {"t": 0.0}

    def clock():
        ticks["t"] += 2.0
        return ticks["t"]

    return Dashboard(fetch, url="http://office:8080", interval=3600, clock=clock)


def test_m_switches_the_model_shown_and_rates_come_from_its_own_counters():
    async def run():
        app = two_model_dashboard()
        async with app.run_test(size=(110, 30)) as pilot:
            await poll_twice(pilot)
            assert app.view.model == "a" and app.view.tok_s == 50.0  # 100 tokens in 2 s
            await pilot.press("m")
            await poll_done(pilot)
            pilot.app.poll()
            await poll_done(pilot)
            assert app.model == "b" and app.view.model == "b"
            assert app.view.tok_s == 150.0  # b's counter: 300 more tokens in 2 s
            assert "sorted by id" in str(app.query_one("#status").render())

    asyncio.run(run())


def test_snapshot_two_models_the_second_shown_with_its_own_figures_and_the_legend(snap_compare):
    async def switch_and_poll(pilot):
        await poll_done(pilot)
        await pilot.press("m")
        await poll_done(pilot)
        pilot.app.poll()
        await poll_done(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(two_model_dashboard(), terminal_size=(100, 30), run_before=switch_and_poll)


def test_every_model_is_named_at_80_columns_however_many():
    """The model list has its own line that wraps, so no model is cut off on a narrow terminal."""
    names = [f"office-model-{i}" for i in range(6)]

    async def fetch(model=None):
        payload, metrics, props = two_model_payload(model, 100)
        payload["models"] = [{"id": name, "status": {"value": "loaded"}} for name in names]
        return payload, metrics, props

    async def run():
        app = Dashboard(fetch, url="http://office:8080", interval=3600)
        async with app.run_test(size=(80, 30)) as pilot:
            await poll_done(pilot)
            models = app.query_one("#models")
            lines = models.render_lines(models.region.reset_offset)
            shown = " ".join(" ".join(line.text for line in lines).split())  # wrapped: one text
            assert models.display and models.region.width <= 80 and len(lines) >= 2
            assert all(f"{name} (loaded)" in shown for name in names), shown

    asyncio.run(run())


def test_at_80_columns_the_header_shows_the_url_and_the_system_line_does_not_wrap():
    """A real model's name and split, and a busy machine's figures, at 80 columns: the URL is
    on the header line (it was cut after the split), the system panel is one line."""
    payload = {**slots(10), "model": "SmolLM2-135M-Instruct.Q4_1",
               "split": "6 slots sharing one cache pool of 8192 tokens, 1365 guaranteed to each "
                        "(one request may use up to 8192)"}
    metrics = METRICS.format(gen=100, b1=0, b2=0) + (
        "localserve:process_cpu_percent 191.0\nlocalserve:system_cpu_count 16\n"
        "localserve:process_resident_memory_bytes 325582848\n"
        "localserve:system_memory_total_bytes 25232932864\n"
        "localserve:system_memory_available_bytes 24570000000\n")

    async def fetch(model=None):
        return payload, metrics, PROPS

    async def run():
        app = Dashboard(fetch, url="http://office-server:8080", interval=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            await poll_done(pilot)
            header = app.query_one("#header")
            line = header.render_lines(header.region.reset_offset)[0].text
            assert "http://office-server:8080" in line, line
            system = app.query_one("#system")
            rows = [r.text.strip(" │") for r in system.render_lines(system.region.reset_offset)]
            assert sum(1 for r in rows if r.strip("─╭╮╰╯ ")) == 1, rows

    asyncio.run(run())
