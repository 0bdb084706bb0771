// Markdown for the chat page, sanitised by construction: every piece of text is escaped
// first, then a few tags are added around it; links are only ever http(s). Blocks: code
// fences (highlighted: strings, comments, numbers, keywords), math ($$ and \[ \], shown as
// set-apart text, not typeset), headings, lists (nested by indentation, numbered from their
// first number, loose ones with blank lines between items), quotes, tables (with their
// column alignment), rules, paragraphs; task list items get a checkbox. Inline: code, bold,
// italic, strikethrough, links. Emphasis needs its marker next to a word (`7 * 8 = 56` keeps
// its asterisks). No inline style: the page's CSP allows none, so alignment and colours are
// classes.
"use strict";

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
                                            '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(escaped) {
  const codes = [];  // code spans are set aside so that nothing inside them is formatted
  const held = escaped.replace(/`([^`\n]+)`/g, (all, code) => {
    codes.push(code);
    return `\u0000${codes.length - 1}\u0000`;
  });
  return held
    .replace(/\*\*(?=\S)([^*\n]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/~~(?=\S)([^~\n]*?\S)~~/g, "<del>$1</del>")
    .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?![\w])/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) =>
      /^https?:\/\//i.test(url) ? `<a href="${url}" rel="noopener noreferrer" target="_blank">${label}</a>`
                                : label)
    .replace(/\u0000(\d+)\u0000/g, (all, i) => `<code>${codes[Number(i)]}</code>`);
}

const ITEM = /^(\s*)([-*+]|\d{1,9}[.)]) /;
const INDENTED = /^\s+\S/;

const BLOCKS = [
  // [test on a line, render the run of lines, (optional) lines that continue the run]
  [/^#{1,6} /, (lines) => lines.map((l) => {
    const level = l.match(/^#+/)[0].length;
    return `<h${level}>${inline(l.slice(level + 1))}</h${level}>`;
  }).join("")],
  [/^&gt; ?/, (lines) => `<blockquote>${blocks(lines.map((l) => l.replace(/^&gt; ?/, "")))}</blockquote>`],
  [ITEM, list, (lines, k) => INDENTED.test(lines[k]) || (!lines[k].trim() && k + 1 < lines.length
                                                         && (ITEM.test(lines[k + 1]) || INDENTED.test(lines[k + 1])))],
  [/^\|.*\|\s*$/, table],
  [/^(-{3,}|\*{3,}|_{3,})\s*$/, (lines) => "<hr>".repeat(lines.length)],
];

function list(lines) {
  // Items by indentation: a deeper item opens a list inside the one before it.
  const items = [];
  for (const line of lines) {
    const m = line.match(ITEM);
    if (m) items.push({ indent: m[1].length, ordered: /\d/.test(m[2]),
                        number: parseInt(m[2], 10), text: line.slice(m[0].length) });
    else if (line.trim() && items.length) items[items.length - 1].text += "\n" + line.trim();
  }
  let at = 0;
  const level = (indent) => {
    const first = items[at];
    const tag = first.ordered ? "ol" : "ul";
    const start = first.ordered && first.number !== 1 ? ` start="${first.number}"` : "";
    let html = "";
    while (at < items.length && items[at].indent >= indent) {
      if (items[at].indent === indent && items[at].ordered !== first.ordered) break;  // a new list
      if (items[at].indent > indent) {  // nested: inside the previous item
        html = html.replace(/<\/li>$/, "") + level(items[at].indent) + "</li>";
        continue;
      }
      html += item(items[at].text);
      at++;
    }
    return `<${tag}${start}>${html}</${tag}>`;
  };
  let html = "";
  while (at < items.length) html += level(items[at].indent);
  return html;
}

function item(text) {
  // A task list's item ("[ ] to do", "[x] done") starts with a checkbox the reader cannot tick.
  const task = text.match(/^\[([ xX])\] /);
  const box = task ? `<input type="checkbox" disabled${task[1] === " " ? "" : " checked"}> ` : "";
  const body = inline(task ? text.slice(4) : text).replace(/\n/g, "<br>");
  return task ? `<li class="task">${box}${body}</li>` : `<li>${body}</li>`;
}

function table(lines) {
  const cells = (line) => line.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
  const divider = lines.length > 1 && /^[\s|:-]+$/.test(lines[1]);
  const align = divider ? cells(lines[1]).map((c) =>
    /^:-+:$/.test(c) ? "center" : /-:$/.test(c) ? "right" : /^:-/.test(c) ? "left" : "") : [];
  const cell = (tag, text, i) => `<${tag}${align[i] ? ` class="${align[i]}"` : ""}>${inline(text)}</${tag}>`;
  const head = divider ? `<thead><tr>${cells(lines[0]).map((c, i) => cell("th", c, i)).join("")}</tr></thead>` : "";
  const rows = (divider ? lines.slice(2) : lines).map((l) =>
    `<tr>${cells(l).map((c, i) => cell("td", c, i)).join("")}</tr>`).join("");
  return `<table>${head}<tbody>${rows}</tbody></table>`;
}

function blocks(lines) {
  let html = "", paragraph = [];
  const flush = () => {
    if (paragraph.length) html += `<p>${inline(paragraph.join("\n")).replace(/\n/g, "<br>")}</p>`;
    paragraph = [];
  };
  for (let i = 0; i < lines.length;) {
    const rule = BLOCKS.find(([test]) => test.test(lines[i]));
    if (!rule) {
      if (lines[i].trim()) paragraph.push(lines[i]); else flush();
      i++;
      continue;
    }
    flush();
    let end = i + 1;
    while (end < lines.length && (rule[0].test(lines[end]) || (rule[2] && rule[2](lines, end)))) end++;
    html += rule[1](lines.slice(i, end));
    i = end;
  }
  flush();
  return html;
}

// ---- code and math -------------------------------------------------------------------------
const KEYWORDS = new Set(("as async await break case catch class const continue def default del " +
  "do elif else enum export extends false final finally fn for from func function go if impl " +
  "import in interface is lambda let match mod mut new nil none null or and not package pass " +
  "private protected pub public raise return self static struct super switch this throw try " +
  "true type typeof use var void where while with yield True False None").split(" "));
const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`|\b\d+(?:\.\d+)?\b|\b[A-Za-z_]\w*\b)/g;

function highlight(code, language) {
  // Each token is escaped on its own and wrapped in a class; the text between as it is.
  const hashComments = /^(py|python|sh|bash|shell|ruby|rb|r|yaml|yml|toml|perl|make|dockerfile)$/i.test(language);
  let html = "", last = 0;
  for (const m of code.matchAll(TOKEN)) {
    const token = m[0];
    let kind = null;
    if (token.startsWith("//") || token.startsWith("/*")) kind = "comment";
    else if (token.startsWith("#")) kind = hashComments ? "comment" : null;
    else if (/^["'`]/.test(token)) kind = "string";
    else if (/^\d/.test(token)) kind = "number";
    else if (KEYWORDS.has(token)) kind = "keyword";
    if (kind === null && token.startsWith("#")) continue;  // not a comment here: plain text
    html += escapeHtml(code.slice(last, m.index));
    html += kind ? `<span class="tok-${kind}">${escapeHtml(token)}</span>` : escapeHtml(token);
    last = m.index + token.length;
  }
  return html + escapeHtml(code.slice(last));
}

function renderMarkdown(text) {
  return text.split(/```/).map((part, i) => {
    if (i % 2 === 1) {  // inside a code fence: the first line may name the language
      const language = (part.match(/^([\w+-]*)\n/) || ["", ""])[1];
      const body = part.replace(/^[\w+-]*\n/, "");
      return `<pre><code class="language-${escapeHtml(language || "text")}">${highlight(body, language)}</code></pre>`;
    }
    return part.split(/\$\$|\\\[|\\\]/).map((piece, j) => j % 2 === 1
      ? `<div class="math">${escapeHtml(piece.trim())}</div>`
      : blocks(escapeHtml(piece).split("\n"))).join("");
  }).join("");
}
