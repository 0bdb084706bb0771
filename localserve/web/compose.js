// The chat page's answer versions (Regenerate keeps the earlier answers, ‹ › switches between
// them), text files attached to a message, and closing the phone-width drawer. Uses app.js's
// state and helpers.
"use strict";

const MAX_FILE_BYTES = 256 * 1024;  // a text file's worth; a slot holds far less anyway

function keepVersions(reply, previous) {
  // The new answer becomes the last of its versions, and the one shown.
  const answer = ({ content, reasoning, model, meta, finish }) =>
    ({ content, reasoning, model, meta, finish });
  if (!previous) return reply;
  const versions = (previous.versions || [answer(previous)]).concat([answer(reply)]);
  return { ...reply, versions, version: versions.length - 1 };
}

function versionPicker(message) {
  const span = document.createElement("span");
  span.className = "versions";
  const step = (by, label) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.setAttribute("aria-label", by < 0 ? "Earlier answer" : "Later answer");
    b.disabled = !!state.controller || !message.versions[message.version + by];
    b.addEventListener("click", () => showVersion(message, message.version + by));
    return b;
  };
  const count = document.createElement("span");
  count.textContent = `${message.version + 1}/${message.versions.length}`;
  span.append(step(-1, "‹"), count, step(1, "›"));
  return span;
}

function showVersion(message, version) {
  // The version shown is the one the conversation goes on from.
  Object.assign(message, message.versions[version], { version });
  redraw();
  save();
}

function attachFile(input) {
  const file = input.files && input.files[0];
  input.value = "";
  if (!file) return;
  if (file.size > MAX_FILE_BYTES) {
    status(`${file.name} is ${Math.round(file.size / 1024)} KB: attach text files of at most ` +
           `${MAX_FILE_BYTES / 1024} KB`, true);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    const text = String(reader.result);
    if (text.includes("\u0000")) return status(`${file.name} is not a text file`, true);
    const box = $("input");
    const fence = text.includes("```") ? "~~~" : "```";
    box.value = (box.value ? box.value.replace(/\s*$/, "\n\n") : "") +
                `${file.name}:\n${fence}\n${text.replace(/\s*$/, "")}\n${fence}\n`;
    status(`Attached ${file.name} (${text.length} characters).`);
    box.focus();
  };
  reader.onerror = () => status(`Could not read ${file.name}`, true);
  reader.readAsText(file);
}

function closeMenu() {
  $("app").classList.remove("nav-open");
}

function chatSettings() {
  // Kept with each conversation, and given back when it is opened again.
  return { system: $("system").value, model: $("model").value,
           temperature: $("temperature").value, max_tokens: $("max-tokens").value };
}

function restoreSettings(settings) {
  $("system").value = settings.system || "";
  if (settings.temperature) $("temperature").value = settings.temperature;
  if (settings.max_tokens) $("max-tokens").value = settings.max_tokens;
  if (!settings.model || state.models.length < 2) return;
  if (state.models.some((m) => m.id === settings.model)) $("model").value = settings.model;
  else status(`This chat used the model ${settings.model}, which this server no longer ` +
              `serves: the next message goes to ${$("model").value}.`, true);
}
