// localserve's chat page. Plain JavaScript, no dependencies, no network beyond this server.
// Safety rule: every piece of user or model text is escaped before any markup is added
// (markdown.js), and links are only ever http(s). The key lives in localStorage (so a new tab
// does not ask again) until "Sign out".
"use strict";

const $ = (id) => document.getElementById(id);
// A phone's keyboard has no Shift+Enter for a new line: there Enter is a new line.
const TOUCH = window.matchMedia("(pointer: coarse)").matches;
const state = { key: localStorage.getItem("localserve-key"), conversation: null, title: null,
                messages: [], controller: null, me: null, models: [], images: [] };

// ---- talking to the server ----------------------------------------------------------
function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(method, path, body) {
  const r = await reach(path, { method, headers: headers(body !== undefined),
                                body: body === undefined ? undefined : JSON.stringify(body) });
  if (!r.ok) throw await errorOf(r);
  return r.json();
}

async function reach(path, options) {
  // fetch, with the browser's bare "Failed to fetch" said in words
  try { return await fetch(path, options); } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new Error("The server cannot be reached (it may be restarting): try again in a moment.");
  }
}

async function copyText(text, button) {
  try { await navigator.clipboard.writeText(text); } catch (_) {  // plain http on a LAN
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function copyButton(text) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "copy";
  b.textContent = "Copy";
  b.addEventListener("click", () => copyText(text(), b));
  return b;
}

async function errorOf(r) {
  let message = `${r.status} ${r.statusText}`;
  try { message = (await r.json()).error.message || message; } catch (_) { /* not JSON */ }
  const e = new Error(message);
  e.status = r.status;
  return e;
}

// ---- the conversation view ------------------------------------------------------------
function show(message, index) {
  const div = document.createElement("div");
  div.className = "message " + message.role;
  if (message.role === "user") {
    div.textContent = message.content;
    if (message.images) div.append(...thumbnails(message.images));
    const edit = document.createElement("button");
    edit.className = "edit";
    edit.type = "button";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => editFrom(index));
    div.prepend(edit);
  } else {
    fill(div, message, true);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function fill(div, message, done) {
  // An answer: its reasoning (folded), its text, and when finished who wrote it, how fast.
  div.replaceChildren();
  div.classList.toggle("pending", !message.content && !message.reasoning);
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    const body = document.createElement("div");
    body.textContent = message.reasoning;
    details.append(summary, body);
    div.append(details);
  }
  const body = document.createElement("div");
  body.className = "body";
  if (div.classList.contains("pending")) body.textContent = "…";
  else body.innerHTML = renderMarkdown(message.content);
  body.querySelectorAll("pre").forEach((pre) =>
    pre.prepend(copyButton(() => pre.querySelector("code").textContent)));
  div.append(body);
  if (done && message.content) {
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = [message.model, message.meta].filter(Boolean).join(" · ");
    if (message.versions && message.versions.length > 1) meta.prepend(versionPicker(message));
    meta.append(copyButton(() => message.content));
    div.append(meta);
  }
}

function redraw() {
  $("messages").replaceChildren();
  state.messages.forEach(show);
  const answer = lastAnswer();
  $("regenerate").hidden = !answer || !!state.controller;
  $("continue").hidden = !answer || !!state.controller || answer.finish === "stop";
}

function lastAnswer() {
  const last = state.messages[state.messages.length - 1];
  return last && last.role === "assistant" ? last : null;
}

function status(text, error = false, waiting = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : waiting ? "waiting" : "";
}

const THEMES = ["auto", "light", "dark"];

function applyTheme(theme) {
  // auto follows the OS (prefers-color-scheme); the choice is kept in this browser
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  localStorage.setItem("localserve-theme", theme);
  $("theme").textContent = "Theme: " + theme;
}

function editFrom(index) {
  if (state.controller) return;
  $("input").value = state.messages[index].content;
  pendImages((state.messages[index].images || []).slice());  // they go again with it
  state.messages = state.messages.slice(0, index);
  redraw();
  $("input").focus();
}

// ---- sending and streaming ------------------------------------------------------------
async function send(text, how = {}) {
  // how.continuing: the last answer goes on where it stopped; how.previous: the answer this
  // one regenerates (kept as an earlier version of it).
  const images = text === null ? [] : state.images;  // attached ones go with a new message
  if (text !== null) {
    state.messages.push(images.length ? { role: "user", content: text, images }
                                      : { role: "user", content: text });
    pendImages([]);
  }
  const continued = how.continuing ? state.messages.pop() : null;
  redraw();
  status("");
  const system = $("system").value.trim();
  const model = $("model").value || undefined;
  const history = state.messages.concat(continued ? [continued] : []);
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(
      history.map(asApiMessage)),
    model, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if (continued) Object.assign(body, { continue_final_message: true, add_generation_prompt: false });
  const reply = continued ? { ...continued, meta: "", finish: undefined }
                          : { role: "assistant", content: "", reasoning: "", model };
  const view = show(reply, state.messages.length);
  state.controller = new AbortController();
  setBusy(true);
  let first = null;
  const queue = watchQueue(() => first === null);
  try {
    const r = await reach("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: state.controller.signal });
    if (!r.ok) throw await errorOf(r);
    await readStream(r, (chunk) => {
      reply.model = chunk.model || reply.model;
      reply.usage = chunk.usage || reply.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.finish_reason) reply.finish = choice.finish_reason;  // Continue's cue
      const delta = choice && choice.delta;
      if (!delta || !(delta.content || delta.reasoning_content)) return;
      if (first === null) { first = performance.now(); status(""); }
      reply.content += delta.content || "";
      reply.reasoning += delta.reasoning_content || "";
      fill(view, reply, false);
    });
    status("");
  } catch (e) {
    if (e.name === "AbortError") status("Stopped.");
    else {
      status(e.message, true);
      if (!reply.content && text !== null) {  // refused: give it back to edit, history clean
        state.messages.pop();
        $("input").value = text;
        pendImages(images);
      }
    }
    if (e.status === 401) return signOut(e.message);
  } finally {
    clearInterval(queue);
    state.controller = null;
    setBusy(false);
  }
  if (reply.usage && first !== null) {
    const tokens = reply.usage.completion_tokens;
    const seconds = Math.max((performance.now() - first) / 1000, 0.001);
    reply.meta = `${tokens} tokens, ${(tokens / seconds).toFixed(1)} tokens/s`;
  }
  if (reply.content) state.messages.push(keepVersions(reply, how.previous));
  else if (how.previous) state.messages.push(how.previous);  // nothing new: the old one stays
  redraw();
  await save();
}

async function readStream(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const data = JSON.parse(line.slice(6));
        if (data.error) throw new Error(data.error.message);
        onChunk(data);
      }
    }
  }
}

function watchQueue(waiting) {
  // While no token has arrived, say whether the request waits for a slot, and where.
  return setInterval(async () => {
    if (!waiting()) return;
    try {
      const slots = await api("GET", "/slots?view=full" + modelQuery());
      if (!waiting()) return;  // the first token came while we asked
      const mine = slots.queue.requests.findIndex((r) => r.user === state.me);
      if (slots.queue.waiting > 0) {
        status(`Queued (position ${mine >= 0 ? mine + 1 : slots.queue.waiting}): all slots are busy.`,
               false, true);
      } else status("Thinking…", false, true);
    } catch (_) { status("Thinking…", false, true); }
  }, 700);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").hidden = $("continue").hidden = true;
}

async function showServer() {
  const panel = $("server");
  panel.hidden = !panel.hidden;
  while (!panel.hidden) {
    try {
      const s = await api("GET", "/slots?view=full" + modelQuery());
      $("server-view").textContent = s.slots.map((r) =>
        `slot ${r.id}  ${r.state.padEnd(7)}  ${r.n_cached}/${r.n_ctx}  ${r.user || ""}`).join("\n") +
        `\n\nwaiting: ${s.queue.waiting}\nmodel: ${s.model}\n${s.split}`;
    } catch (e) { $("server-view").textContent = e.message; }
    await new Promise((done) => setTimeout(done, 1000));
  }
}

// ---- models ------------------------------------------------------------------------------
function modelQuery() {
  return $("model").value ? "&model=" + encodeURIComponent($("model").value) : "";
}

async function listModels() {
  // The picker shows only when there is a choice; every answer says which model wrote it.
  const { data } = await api("GET", "/v1/models");
  state.models = data.filter((m) => m.kind !== "embedding");
  const picker = $("model");
  picker.replaceChildren(...state.models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.status && m.status.value !== "loaded" ? `${m.id} (${m.status.value})` : m.id;
    return option;
  }));
  $("model-picker").hidden = state.models.length < 2;
}

// ---- signing in -------------------------------------------------------------------------
function signOut(message) {
  localStorage.removeItem("localserve-key");
  state.key = null;
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function start() {
  let r;
  try {
    if (!state.key && (await (await reach("/web/sign-in")).json()).needs_key) return signOut("");
    r = await reach("/v1/models", { headers: headers(false) });
  } catch (e) {
    // the server is away (restarting?): say so, and try again until it answers
    $("app").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = "Reconnecting… " + e.message;
    setTimeout(start, 3000);
    return;
  }
  if (r.status === 401) return signOut(state.key ? (await errorOf(r)).message : "");
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = !state.key;
  try { state.me = (await api("GET", "/web/api/whoami")).user; } catch (_) { state.me = null; }
  $("whoami").textContent = state.me && state.key ? "Signed in as " + state.me : "";
  await listModels();
  const chats = await listConversations();
  const last = localStorage.getItem("localserve-last-" + (state.me || ""));
  if (last && chats.some((c) => c.id === last)) await openConversation(last);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key").value.trim();
    localStorage.setItem("localserve-key", state.key);
    start();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if ((!text && !state.images.length) || state.controller) return;
    $("input").value = "";
    send(text);
  });
  if (TOUCH) $("input").placeholder = "Type a message";  // Enter is a new line; Send sends
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !TOUCH) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", () => {
    if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
      send(null, { previous: state.messages.pop() });
    }
  });
  $("continue").addEventListener("click", () => {
    if (lastAnswer()) send(null, { continuing: true });
  });
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", () => attachFile($("file")));
  $("close-server").addEventListener("click", () => { $("server").hidden = true; });
  $("close-menu").addEventListener("click", closeMenu);
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    closeMenu();
    $("server").hidden = true;
  });
  $("app").addEventListener("click", (e) => {  // a tap beside the open drawer closes it
    if ($("app").classList.contains("nav-open") && !$("sidebar").contains(e.target)
        && e.target !== $("menu")) closeMenu();
  });
  $("new-chat").addEventListener("click", newChat);
  $("export").addEventListener("click", exportChats);
  $("toggle-server").addEventListener("click", showServer);
  $("logout").addEventListener("click", () => signOut(""));
  $("search").addEventListener("input", () => listConversations());
  $("menu").addEventListener("click", () => $("app").classList.toggle("nav-open"));
  $("theme").addEventListener("click", () => {
    const now = localStorage.getItem("localserve-theme") || "auto";
    applyTheme(THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
  });
  applyTheme(localStorage.getItem("localserve-theme") || "auto");
  start();
});
