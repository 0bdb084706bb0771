// localserve's chat page. Plain JavaScript, no dependencies, no network beyond this server.
// Safety rule: every piece of user or model text is escaped before any markup is added
// (renderMarkdown), and links are only ever http(s). The key lives in sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("localserve-key"), conversation: null,
                messages: [], controller: null, me: null };

// ---- talking to the server ----------------------------------------------------------
function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(method, path, body) {
  const r = await fetch(path, { method, headers: headers(body !== undefined),
                                body: body === undefined ? undefined : JSON.stringify(body) });
  if (!r.ok) throw await errorOf(r);
  return r.json();
}

async function errorOf(r) {
  let message = `${r.status} ${r.statusText}`;
  try { message = (await r.json()).error.message || message; } catch (_) { /* not JSON */ }
  const e = new Error(message);
  e.status = r.status;
  return e;
}

// ---- markdown, sanitised: escape first, then add a few tags ---------------------------
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
                                            '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(escaped) {
  return escaped
    .replace(/`([^`\n]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) =>
      /^https?:\/\//i.test(url) ? `<a href="${url}" rel="noopener noreferrer" target="_blank">${label}</a>`
                                : label);
}

function renderMarkdown(text) {
  const parts = text.split(/```/);
  return parts.map((part, i) => {
    if (i % 2 === 1) {  // inside a code fence: the first line may name the language
      const body = part.replace(/^[\w+-]*\n/, "");
      return `<pre><code>${escapeHtml(body)}</code></pre>`;
    }
    return escapeHtml(part).split(/\n{2,}/).map((p) => p.trim() ?
      `<p>${inline(p).replace(/\n/g, "<br>")}</p>` : "").join("");
  }).join("");
}

// ---- the conversation view ------------------------------------------------------------
function show(message, index) {
  const div = document.createElement("div");
  div.className = "message " + message.role;
  if (message.role === "user") {
    div.textContent = message.content;
    const edit = document.createElement("button");
    edit.className = "edit";
    edit.type = "button";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => editFrom(index));
    div.prepend(edit);
  } else {
    div.innerHTML = renderMarkdown(message.content);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function redraw() {
  $("messages").replaceChildren();
  state.messages.forEach(show);
  const last = state.messages[state.messages.length - 1];
  $("regenerate").hidden = !last || last.role !== "assistant" || !!state.controller;
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function editFrom(index) {
  if (state.controller) return;
  $("input").value = state.messages[index].content;
  state.messages = state.messages.slice(0, index);
  redraw();
  $("input").focus();
}

// ---- sending and streaming ------------------------------------------------------------
async function send(text) {
  if (text) state.messages.push({ role: "user", content: text });
  redraw();
  const system = $("system").value.trim();
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true, temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  const reply = { role: "assistant", content: "" };
  const view = show(reply, state.messages.length);
  state.controller = new AbortController();
  setBusy(true);
  const queue = watchQueue(() => reply.content === "");
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: state.controller.signal });
    if (!r.ok) throw await errorOf(r);
    await readStream(r, (delta) => { reply.content += delta; view.innerHTML = renderMarkdown(reply.content); });
    status("");
  } catch (e) {
    if (e.name === "AbortError") status("Stopped.");
    else {
      status(e.message, true);
      if (!reply.content && text) {  // refused: give the text back to edit, keep history clean
        state.messages.pop();
        $("input").value = text;
      }
    }
    if (e.status === 401) return signOut(e.message);
  } finally {
    clearInterval(queue);
    state.controller = null;
    setBusy(false);
  }
  if (reply.content) state.messages.push(reply);
  redraw();
  await save();
}

async function readStream(response, onText) {
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
        const delta = data.choices && data.choices[0] && data.choices[0].delta;
        if (delta && delta.content) onText(delta.content);
      }
    }
  }
}

function watchQueue(waiting) {
  // While no token has arrived, say whether the request waits for a slot, and where.
  return setInterval(async () => {
    if (!waiting()) return;
    try {
      const slots = await api("GET", "/slots?view=full");
      const mine = slots.queue.requests.findIndex((r) => r.user === state.me);
      if (slots.queue.waiting > 0) {
        status(`Queued (position ${mine >= 0 ? mine + 1 : slots.queue.waiting}): all slots are busy.`);
      } else status("Thinking…");
    } catch (_) { status("Thinking…"); }
  }, 700);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").hidden = true;
}

// ---- conversations, kept on the server ------------------------------------------------
async function save() {
  if (!state.messages.length) return;
  const first = state.messages.find((m) => m.role === "user");
  const title = first ? first.content.slice(0, 60) : "New chat";
  const id = state.conversation || crypto.randomUUID().replace(/-/g, "");
  try {
    await api("PUT", "/web/api/conversations/" + id, { title, messages: state.messages,
      settings: { system: $("system").value } });
    state.conversation = id;
    await listConversations();
  } catch (e) { status("Could not save this chat: " + e.message, true); }
}

async function listConversations() {
  const { data } = await api("GET", "/web/api/conversations");
  const list = $("conversations");
  list.replaceChildren();
  for (const c of data) {
    const li = document.createElement("li");
    li.className = c.id === state.conversation ? "current" : "";
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = c.title || "Untitled";
    open.addEventListener("click", () => openConversation(c.id));
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "×";
    del.title = "Delete";
    del.addEventListener("click", async () => {
      await api("DELETE", "/web/api/conversations/" + c.id);
      if (state.conversation === c.id) newChat();
      await listConversations();
    });
    li.append(open, del);
    list.append(li);
  }
}

async function openConversation(id) {
  const c = await api("GET", "/web/api/conversations/" + id);
  state.conversation = id;
  state.messages = c.messages;
  $("system").value = (c.settings && c.settings.system) || "";
  redraw();
  await listConversations();
}

function newChat() {
  state.conversation = null;
  state.messages = [];
  redraw();
  status("");
}

async function exportChats() {
  const r = await fetch("/web/api/conversations/export", { headers: headers(false) });
  const blob = await r.blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "conversations.json";
  a.click();
}

async function showServer() {
  const panel = $("server");
  panel.hidden = !panel.hidden;
  while (!panel.hidden) {
    try {
      const s = await api("GET", "/slots?view=full");
      $("server-view").textContent = s.slots.map((r) =>
        `slot ${r.id}  ${r.state.padEnd(7)}  ${r.n_cached}/${r.n_ctx}  ${r.user || ""}`).join("\n") +
        `\n\nwaiting: ${s.queue.waiting}\nmodel: ${s.model}\n${s.split}`;
    } catch (e) { $("server-view").textContent = e.message; }
    await new Promise((done) => setTimeout(done, 1000));
  }
}

// ---- signing in -------------------------------------------------------------------------
function signOut(message) {
  sessionStorage.removeItem("localserve-key");
  state.key = null;
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function start() {
  const r = await fetch("/v1/models", { headers: headers(false) });
  if (r.status === 401) return signOut(state.key ? (await errorOf(r)).message : "");
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = !state.key;
  try { state.me = (await api("GET", "/web/api/whoami")).user; } catch (_) { state.me = null; }
  await listConversations();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key").value.trim();
    sessionStorage.setItem("localserve-key", state.key);
    start();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", () => {
    if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
      state.messages.pop();
      send(null);
    }
  });
  $("new-chat").addEventListener("click", newChat);
  $("export").addEventListener("click", exportChats);
  $("toggle-server").addEventListener("click", showServer);
  $("logout").addEventListener("click", () => signOut(""));
  start();
});
