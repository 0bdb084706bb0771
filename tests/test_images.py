"""Images in chats (issue 70), on the real server: the embedded model with a random-weight
projector of its width (scripts/make-projector; no hub download). Its answers about an image
are noise; the counts, the cache and the refusals are what is checked."""

from __future__ import annotations

import base64

import httpx
import pytest

from conftest import png, random_projector, running, wait_for

pytestmark = pytest.mark.model

ROWS = 16  # the random projector's image tokens (random_projector.py: 64 px in 16-px patches)


@pytest.fixture(scope="module")
def projector() -> str:
    return random_projector()


@pytest.fixture(scope="module")
def vision(projector):
    with running("-c", "4096", "-np", "4", "-t", "2", "--mmproj", projector, "--image-urls",
                 log_name="images") as srv:
        yield srv


def openai_chat(image: str, question: str = "What is in the picture?", **extra) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}],
        "max_tokens": 8, "temperature": 0, **extra}


def text_only(question: str = "What is in the picture?") -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0}


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def test_an_image_is_counted_in_the_prompt_and_cached_on_a_follow_up(vision):
    image = png()
    plain = post(vision, "/v1/chat/completions", text_only()).json()["usage"]
    first = post(vision, "/v1/chat/completions", openai_chat(image))
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    # the image's rows are prompt tokens (as llama-server counts them)
    assert usage["prompt_tokens"] == plain["prompt_tokens"] + ROWS
    again = post(vision, "/v1/chat/completions", openai_chat(image)).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    other = post(vision, "/v1/chat/completions", openai_chat(png((10, 200, 30)))).json()["usage"]
    # another image: only the text before it is reused
    assert other["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - ROWS


def test_the_answer_reads_the_image(vision):
    """Greedy answers about the same image agree; another image (the encoder's other output)
    changes the answer: the rows were decoded from the image, not left as placeholders."""
    def answer(image: str) -> str:
        reply = post(vision, "/v1/chat/completions", openai_chat(image, max_tokens=12))
        return reply.json()["choices"][0]["message"]["content"]
    blue, yellow = png((1, 2, 250)), png((250, 250, 5), size=(300, 40))
    assert answer(blue) == answer(blue)
    assert answer(blue) != answer(yellow)


def test_every_api_shape_places_the_image(vision):
    image = png((90, 90, 90))
    base = post(vision, "/v1/chat/completions", text_only("Describe.")).json()["usage"]
    anthropic = post(vision, "/v1/messages", {
        "model": "m", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": image}},
            {"type": "text", "text": "Describe."}]}]})
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["usage"]["input_tokens"] >= base["prompt_tokens"] + ROWS - 2
    responses = post(vision, "/v1/responses", {
        "max_output_tokens": 16, "temperature": 0, "store": False, "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "Describe."},
                {"type": "input_image", "image_url": f"data:image/png;base64,{image}"}]}]})
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"]["input_tokens"] >= base["prompt_tokens"] + ROWS - 2
    ollama = post(vision, "/api/chat", {"model": "m", "stream": False, "options": {
        "num_predict": 8, "temperature": 0}, "messages": [
        {"role": "user", "content": "Describe.", "images": [image]}]})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["prompt_eval_count"] >= base["prompt_tokens"] + ROWS - 2
    generate = post(vision, "/api/generate", {"model": "m", "stream": False, "prompt": "Describe.",
                                              "images": [image], "options": {"num_predict": 4}})
    assert generate.status_code == 200, generate.text
    assert generate.json()["prompt_eval_count"] >= ROWS


def test_an_image_inside_a_tool_result(vision):
    image = png((5, 5, 5))
    reply = post(vision, "/v1/messages", {
        "model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": image}}]}]}],
        "tools": [{"name": "shot", "description": "a screenshot", "input_schema": {
            "type": "object", "properties": {}}}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["input_tokens"] > ROWS


@pytest.mark.parametrize("content, says", [
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(),
     "image is"),
    ("data:image/png;base64," + png()[:60], "image is"),  # truncated
    ("data:image/tiff;base64," + base64.b64encode(b"II*\0" + b"\0" * 64).decode(), "image is"),
    ("file:///etc/passwd", "data URI"),
])
def test_bad_images_are_refused_with_a_400_naming_them(vision, content, says):
    body = openai_chat("x")
    body["messages"][0]["content"][1]["image_url"]["url"] = content
    reply = post(vision, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == "messages[0].content[1]"
    assert post(vision, "/v1/chat/completions", text_only()).status_code == 200


def test_a_huge_image_and_too_many_images_are_refused(vision):
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    # a 20000 x 20000 PNG header: a decompression bomb is refused before any pixel is decoded
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
    reply = post(vision, "/v1/chat/completions",
                 openai_chat(base64.b64encode(bomb + chunk(b"IEND", b"")).decode()))
    assert reply.status_code == 400 and "million" in reply.json()["error"]["message"]
    many = openai_chat(png())
    many["messages"][0]["content"] += [many["messages"][0]["content"][1]] * 16
    reply = post(vision, "/v1/chat/completions", many)
    assert reply.status_code == 400 and "at most 16" in reply.json()["error"]["message"]
    assert post(vision, "/v1/chat/completions", text_only()).status_code == 200


def test_llama_servers_multimodal_data_places_each_image_at_its_marker(vision):
    """llama-server's /completion prompt object: each <__media__> is the next base64 image;
    the images' rows count among the prompt's tokens, and a second run finds them cached."""
    def completion(prompt) -> httpx.Response:
        return post(vision, "/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0})

    pieces = ["A picture: ", " and another: ", " Which is red?"]
    n_text = sum(len(post(vision, "/tokenize", {"content": piece, "add_special": i == 0}).json()[
        "tokens"]) for i, piece in enumerate(pieces))
    two = {"prompt_string": "<__media__>".join(pieces),
           "multimodal_data": [png(), png((5, 5, 250))]}
    first = completion(two)
    assert first.status_code == 200, first.text
    assert first.json()["tokens_evaluated"] == n_text + 2 * ROWS
    assert completion(two).json()["tokens_cached"] >= n_text + 2 * ROWS - 1
    assert completion({"prompt_string": "no marker"}).status_code == 200
    for prompt, says in (({"prompt_string": "one <__media__>", "multimodal_data": []},
                          "1 <__media__> markers for 0 items"),
                         ({"prompt_string": "<__media__>", "multimodal_data": ["@@"]},
                          "prompt.multimodal_data[0]: the image is not valid base64")):
        reply = completion(prompt)
        assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text


def test_a_text_model_refuses_an_image_naming_the_model_and_the_fix(server):
    for path, body in (
            ("/v1/chat/completions", openai_chat(png())),
            ("/completion", {"prompt": {"prompt_string": "<__media__>",
                                        "multimodal_data": [png()]}}),
            ("/api/chat", {"model": "m", "stream": False, "messages": [
                {"role": "user", "content": "hi", "images": [png()]}]})):
        reply = post(server, path, body)
        assert reply.status_code == 400, reply.text
        assert "reads text only" in reply.text and "--mmproj" in reply.text


def test_two_colleagues_with_images_at_once(vision):
    import concurrent.futures

    bodies = [openai_chat(png((i * 40, 10, 10))) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda b: post(vision, "/v1/chat/completions", b), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.json()["usage"]["prompt_tokens"] for r in replies}) == 1


def test_image_addresses_are_refused_unless_the_admin_allows_fetching():
    from localserve.api.images import from_url
    from localserve.api.schemas import OpenAIError

    with pytest.raises(OpenAIError) as refused:
        from_url("https://example.com/cat.png", "messages[0].content[1]")
    assert "does not fetch images" in refused.value.message and "--image-urls" in refused.value.message
    assert refused.value.param == "messages[0].content[1]"
    assert from_url("https://example.com/cat.png", "x", fetch=True).url


def test_image_addresses_are_fetched_where_the_admin_allows_it(projector, tmp_path):
    """--image-urls: an address is fetched, bounded; a loopback one only from a host the admin
    named (--image-url-host), and every refusal says the same (hardening round 7)."""
    import functools
    import http.server
    import threading

    (tmp_path / "cat.png").write_bytes(base64.b64decode(png((30, 60, 90))))
    (tmp_path / "big.png").write_bytes(b"\0" * (21 * 1024 * 1024))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    port = files.server_address[1]

    def ask(srv, url):
        body = openai_chat("x")
        body["messages"][0]["content"][1]["image_url"]["url"] = url
        return post(srv, "/v1/chat/completions", body)
    try:
        with running("-c", "2048", "-np", "2", "-t", "2", "--mmproj", projector, "--image-urls",
                     "--image-url-host", "localhost", log_name="image-hosts") as srv:
            fetched = ask(srv, f"http://localhost:{port}/cat.png")
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["usage"]["prompt_tokens"] > ROWS
            refusals = [ask(srv, url) for url in (
                f"http://localhost:{port}/missing.png", f"http://localhost:{port}/big.png",
                f"http://127.0.0.1:{port}/cat.png",  # loopback, not a host the admin named
                f"{srv.url}/health", "http://169.254.169.254/latest/meta-data/",
                "http://[::ffff:127.0.0.1]/", "http://10.0.0.1/cat.png")]
            assert {r.status_code for r in refusals} == {400}
            assert len({r.json()["error"]["message"] for r in refusals}) == 1
            assert "public addresses only" in refusals[0].json()["error"]["message"]
    finally:
        files.shutdown()


def test_only_global_unicast_addresses_are_public():
    from localserve.api.image_fetch import is_public

    for address in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                    "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1%eth0", "fd00::1",
                    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "ff02::1"):
        assert not is_public(address), address
    assert is_public("93.184.216.34") and is_public("2606:2800:220:1:248:1893:25c8:1946")


def test_props_and_models_say_the_model_reads_images(vision, server):
    props = httpx.get(vision.url + "/props").json()
    assert props["modalities"]["vision"] is True
    assert httpx.get(server.url + "/props").json()["modalities"]["vision"] is False
    show = httpx.post(vision.url + "/api/show", json={"model": "m"}).json()
    assert "vision" in show["capabilities"]
    assert "images: read with the projector" in vision.log()  # the start-up says so
    assert "images:" not in server.log()
    for srv, capabilities in ((vision, ["completion", "multimodal"]), (server, ["completion"])):
        listed = httpx.get(srv.url + "/v1/models").json()["models"]  # llama-server's list
        assert [m["capabilities"] for m in listed] == [capabilities]


def test_apply_template_shows_an_image_as_llama_servers_marker_never_the_servers_own(vision):
    shown = post(vision, "/apply-template", {"messages": openai_chat(png())["messages"]})
    assert shown.status_code == 200, shown.text
    assert "<__media__>" in shown.json()["prompt"] and "<image-" not in shown.json()["prompt"]


def test_a_chats_input_tokens_count_its_image_as_a_request_would(vision):
    counted = post(vision, "/chat/completions/input_tokens", openai_chat(png()))
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": post(
        vision, "/v1/chat/completions", openai_chat(png())).json()["usage"]["prompt_tokens"]}


def test_a_prompt_ending_with_an_image_is_refused_and_ends_no_colleagues_answer(vision):
    """Hardening round 7, case 1: the model answers from a text token, so a prompt whose last
    row is an image's is refused with a 400 before it is queued; colleagues' streams running
    meanwhile end as they would alone."""
    import concurrent.futures

    def stream(question: str) -> list[str]:
        body = {**text_only(question), "max_tokens": 40, "stream": True}
        with httpx.stream("POST", vision.url + "/v1/chat/completions", json=body,
                          timeout=300) as reply:
            return [line for line in reply.iter_lines() if '"finish_reason": "' in line]

    ending = openai_chat(png(), continue_final_message=True, add_generation_prompt=False)
    ending["messages"].append({"role": "assistant", "content": [
        {"type": "text", "text": "Here it is again:"}, ending["messages"][0]["content"][1]]})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        colleagues = [pool.submit(stream, q) for q in ("Count to twenty.", "Name ten colours.")]
        for path, body in (("/completion", {"prompt": {"prompt_string": "hi <__media__>",
                                                       "multimodal_data": [png()]}}),
                           ("/v1/chat/completions", ending)):
            reply = post(vision, path, body)
            assert reply.status_code == 400, reply.text
            assert "ends with an image" in reply.json()["error"]["message"]
        ends = [future.result() for future in colleagues]
    assert all(len(end) == 1 and '"finish_reason": "error"' not in end[0] for end in ends), ends


def test_a_dripping_image_server_is_cut_at_the_deadline_and_holds_up_no_colleagues_chat(projector):
    """Hardening round 7, case 4: fetches run on the event loop within one deadline each, so a
    server that drips its headers neither keeps a fetch past it nor takes the threads that
    tokenize colleagues' chats."""
    import concurrent.futures
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    connected, stop = [], threading.Event()

    def drip(conn):
        connected.append(conn)
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while not stop.wait(0.5):
            try:
                conn.sendall(b"X-Drip: 1\r\n")
            except OSError:
                return

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    url = f"http://localhost:{listener.getsockname()[1]}/cat.png"
    try:
        with running("-c", "2048", "-np", "2", "-t", "2", "--mmproj", projector, "--image-urls",
                     "--image-url-host", "localhost", log_name="image-drip") as srv:
            body = openai_chat("x")
            body["messages"][0]["content"][1]["image_url"]["url"] = url
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                drips = [pool.submit(post, srv, "/v1/chat/completions", body) for _ in range(4)]
                wait_for(lambda: len(connected) >= 2, 60, "two fetches dripping")
                chat = post(srv, "/v1/chat/completions", text_only())
                assert chat.status_code == 200 and not any(d.done() for d in drips)
                ends = [d.result() for d in drips]
            assert all(r.status_code == 400 and "within 10 s" in r.text for r in ends)
    finally:
        stop.set()
        listener.close()


def test_the_readmes_image_example_runs_as_written(vision, tmp_path):
    """README's curl with an image (data URI from `base64 -w0 photo.png`), run as written
    against a server with a projector."""
    import base64
    import subprocess

    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    block = readme.split("An image in a chat:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    (tmp_path / "photo.png").write_bytes(base64.b64decode(png()))
    done = subprocess.run(["bash", "-euc", block.replace("http://127.0.0.1:8080", vision.url)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert '"choices"' in done.stdout, done.stdout + done.stderr


def test_the_vision_encoder_runs_on_its_own_thread_never_the_engines(projector, monkeypatch):
    """Hardening round 7, case 5: the engine loop hands the images admission waits for to the
    runner (encode_ahead), whose projector encodes them on its encoder's thread, once each; a
    failed encode is the image's refusal (its request alone ends), never an exception in a
    step. In-process: the runner on the embedded model with the random projector."""
    import threading

    import llama_cpp.mtmd_cpp as M

    from localserve.common.config import resolve_model
    from localserve.engine.runner import LlamaRunner, RunnerConfig

    threads, real = [], M.mtmd_encode_chunk
    monkeypatch.setattr(M, "mtmd_encode_chunk", lambda ctx, chunk: threads.append(
        threading.current_thread().name) or real(ctx, chunk))
    runner = LlamaRunner(RunnerConfig(str(resolve_model(None)), ctx_size=1024, n_slots=1,
                                      n_batch=256, n_threads=2, mmproj=projector))
    try:
        images = [next(iter(runner.projector.prepare(bytes([i * 40]) * 64 * 64 * 3, 64, 64,
                                                     bytes([i]) * 32)[1].values()))
                  for i in range(2)]
        runner.encode_ahead([images[0], images[0]])
        wait_for(lambda: images[0].ready, what="the image encoded")
        assert images[0].embeddings.shape == (ROWS, runner.n_embd) and images[0].failed is None
        assert threads == ["image-encode_0"]  # once, on the encoder's thread
        monkeypatch.setattr(M, "mtmd_encode_chunk", lambda ctx, chunk: 1)
        runner.encode_ahead([images[1]])
        wait_for(lambda: images[1].ready, what="the failure recorded")
        assert images[1].embeddings is None and "failed to encode" in images[1].failed
    finally:
        runner.close()


def test_image_embeddings_as_llama_server_takes_them(vision):
    """llama.cpp's own vision tests (test_vision_embeddings, test_vision_embeddings_oai_content):
    an image in an embedding input, as llama-server's `{prompt_string, multimodal_data}` (on
    /embeddings' `content` too) and as OpenAI content parts on /v1/embeddings. The same text and
    image give the same vector either way; the text alone, or another image, another vector;
    an input may end with an image; a malformed image is a 400 naming it."""
    red, blue = png((200, 30, 40)), png((30, 40, 200))
    asked = {"prompt_string": "What is this: <__media__>\n", "multimodal_data": [red]}
    parts = {"content": [{"type": "text", "text": "What is this: "},
                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{red}"}},
                         {"type": "text", "text": "\n"}]}
    r = httpx.post(vision.url + "/v1/embeddings", timeout=120, json={"input": [
        parts, asked, "What is this: \n", {**asked, "multimodal_data": [blue]},
        {"prompt_string": "<__media__>", "multimodal_data": [red]}]})
    assert r.status_code == 200, r.text
    vectors = [item["embedding"] for item in r.json()["data"]]
    assert vectors[0] == vectors[1] and len({tuple(v) for v in vectors}) == 4
    assert r.json()["usage"]["prompt_tokens"] > 4 * ROWS
    bare = httpx.post(vision.url + "/embeddings", timeout=120, json={"content": [asked, asked]})
    assert bare.status_code == 200, bare.text
    assert [item["embedding"] for item in bare.json()] == [[vectors[1]]] * 2  # llama-server's
    bad = httpx.post(vision.url + "/v1/embeddings", timeout=120, json={
        "input": [{**asked, "multimodal_data": ["malformed"]}]})
    assert bad.status_code == 400 and "input[0]" in bad.text
