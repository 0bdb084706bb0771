// The chat page's answer versions (Regenerate keeps the earlier answers, ‹ › switches between
// them), text files and images attached to a message, and closing the phone-width drawer.
// Uses app.js's state and helpers.
"use strict";

const MAX_FILE_BYTES = 256 * 1024;  // a text file's worth; a slot holds far less anyway
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;  // the server's bound on one image
const IMAGE_SIDE = 1024;  // shrunk in the page: the projector shrinks it further anyway, and a
                          // stored chat (at most 2 MB) keeps it

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
  if (file.type.startsWith("image/")) return attachImage(file);
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

function attachImage(file) {
  // An image goes with the next message (for a model served with its projector; a text
  // model's refusal says so), as a JPEG at most IMAGE_SIDE pixels a side.
  if (file.size > MAX_IMAGE_BYTES) return status(`${file.name} is over 20 MB`, true);
  const reader = new FileReader();
  reader.onload = () => {
    const img = new Image();
    img.onload = () => {
      const scale = Math.min(1, IMAGE_SIDE / Math.max(img.width, img.height));
      const canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(img.width * scale));
      canvas.height = Math.max(1, Math.round(img.height * scale));
      canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
      pendImages(state.images.concat([canvas.toDataURL("image/jpeg", 0.85)]));
      status(`Attached ${file.name} (an image).`);
      $("input").focus();
    };
    img.onerror = () => status(`${file.name} is not an image this browser reads`, true);
    img.src = reader.result;
  };
  reader.onerror = () => status(`Could not read ${file.name}`, true);
  reader.readAsDataURL(file);
}

function thumbnails(urls) {
  return urls.map((url) => {
    const img = document.createElement("img");
    img.className = "attached";
    img.alt = "attached image";
    img.src = url;
    return img;
  });
}

function pendImages(images) {
  // The images waiting for the next message, shown above the input; × drops them.
  state.images = images;
  const box = $("pending-images");
  box.replaceChildren(...thumbnails(state.images));
  box.hidden = !state.images.length;
  if (state.images.length) {
    const drop = document.createElement("button");
    drop.type = "button";
    drop.textContent = "×";
    drop.setAttribute("aria-label", "Remove the attached images");
    drop.addEventListener("click", () => pendImages([]));
    box.append(drop);
  }
}

function asApiMessage({ role, content, images }) {
  // A message with images goes as OpenAI's content parts: its text, then each image.
  if (!images || !images.length) return { role, content };
  return { role, content: [{ type: "text", text: content },
    ...images.map((url) => ({ type: "image_url", image_url: { url } }))] };
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
