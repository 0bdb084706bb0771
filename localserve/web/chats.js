// The chat page's conversations, kept on the server per key (conversations.py): save after
// every exchange, list with search, open, rename, delete (after asking), export, and reopen
// the last one after a reload. Uses app.js's state and helpers.
"use strict";

async function save() {
  if (!state.messages.length) return;
  const first = state.messages.find((m) => m.role === "user");
  const title = state.title || (first ? first.content.slice(0, 60) : "New chat");
  const id = state.conversation || crypto.randomUUID().replace(/-/g, "");
  try {
    await api("PUT", "/web/api/conversations/" + id, { title, messages: state.messages,
      settings: chatSettings() });
    state.conversation = id;
    remember(id);
    await listConversations();
  } catch (e) { status("Could not save this chat: " + e.message, true); }
}

async function listConversations() {
  const { data } = await api("GET", "/web/api/conversations");
  const wanted = $("search").value.trim().toLowerCase();
  const list = $("conversations");
  list.replaceChildren();
  for (const c of data.filter((c) => (c.title || "").toLowerCase().includes(wanted))) {
    const li = document.createElement("li");
    li.className = c.id === state.conversation ? "current" : "";
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = c.title || "Untitled";
    open.addEventListener("click", () => openConversation(c.id));
    li.append(open, smallButton("✎", "Rename", () => rename(c)),
              smallButton("×", "Delete", () => remove(c)));
    list.append(li);
  }
  return data;
}

function smallButton(label, title, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.title = title;
  b.setAttribute("aria-label", title);
  b.addEventListener("click", action);
  return b;
}

async function rename(c) {
  const title = prompt("Rename this chat", c.title || "");
  if (!title || !title.trim()) return;
  const whole = await api("GET", "/web/api/conversations/" + c.id);
  await api("PUT", "/web/api/conversations/" + c.id, { title: title.trim().slice(0, 200),
    messages: whole.messages, settings: whole.settings || {} });
  if (state.conversation === c.id) state.title = title.trim();
  await listConversations();
}

async function remove(c) {
  if (!confirm(`Delete "${c.title || "Untitled"}"? This cannot be undone.`)) return;
  await api("DELETE", "/web/api/conversations/" + c.id);
  if (state.conversation === c.id) newChat();
  await listConversations();
}

async function openConversation(id) {
  const c = await api("GET", "/web/api/conversations/" + id);
  state.conversation = id;
  state.title = c.title;
  state.messages = c.messages;
  restoreSettings(c.settings || {});
  remember(id);
  redraw();
  $("app").classList.remove("nav-open");
  await listConversations();
}

function remember(id) {
  // reopened after a reload
  localStorage.setItem("localserve-last-" + (state.me || ""), id || "");
}

function newChat() {
  state.conversation = state.title = null;
  state.messages = [];
  pendImages([]);
  remember(null);
  $("app").classList.remove("nav-open");
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

