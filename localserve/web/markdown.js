// Markdown for the chat page, sanitised by construction: every piece of text is escaped
// first, then a few tags are added around it; links are only ever http(s). Blocks: code
// fences, headings, lists, quotes, tables, rules, paragraphs. Inline: code, bold, italic,
// links. Emphasis needs its marker next to a word (`7 * 8 = 56` keeps its asterisks).
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
    .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=\S)([^_\n]*?\S)_(?![\w])/g, "$1<em>$2</em>")
    .replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) =>
      /^https?:\/\//i.test(url) ? `<a href="${url}" rel="noopener noreferrer" target="_blank">${label}</a>`
                                : label)
    .replace(/\u0000(\d+)\u0000/g, (all, i) => `<code>${codes[Number(i)]}</code>`);
}

const BLOCKS = [
  // [test on a line, render the run of lines that pass it]
  [/^#{1,6} /, (lines) => lines.map((l) => {
    const level = l.match(/^#+/)[0].length;
    return `<h${level}>${inline(l.slice(level + 1))}</h${level}>`;
  }).join("")],
  [/^&gt; ?/, (lines) => `<blockquote>${blocks(lines.map((l) => l.replace(/^&gt; ?/, "")))}</blockquote>`],
  [/^\s*[-*+] /, (lines) => `<ul>${lines.map((l) => `<li>${inline(l.replace(/^\s*[-*+] /, ""))}</li>`).join("")}</ul>`],
  [/^\s*\d+[.)] /, (lines) => `<ol>${lines.map((l) => `<li>${inline(l.replace(/^\s*\d+[.)] /, ""))}</li>`).join("")}</ol>`],
  [/^\|.*\|\s*$/, table],
  [/^(-{3,}|\*{3,}|_{3,})\s*$/, (lines) => "<hr>".repeat(lines.length)],
];

function table(lines) {
  const cells = (line) => line.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
  const divider = lines.length > 1 && /^[\s|:-]+$/.test(lines[1]);
  const head = divider ? `<thead><tr>${cells(lines[0]).map((c) => `<th>${inline(c)}</th>`).join("")}</tr></thead>` : "";
  const rows = (divider ? lines.slice(2) : lines).map((l) =>
    `<tr>${cells(l).map((c) => `<td>${inline(c)}</td>`).join("")}</tr>`).join("");
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
    let end = i;
    while (end < lines.length && rule[0].test(lines[end])) end++;
    html += rule[1](lines.slice(i, end));
    i = end;
  }
  flush();
  return html;
}

function renderMarkdown(text) {
  return text.split(/```/).map((part, i) => {
    if (i % 2 === 1) {  // inside a code fence: the first line may name the language
      const body = part.replace(/^[\w+-]*\n/, "");
      return `<pre><code>${escapeHtml(body)}</code></pre>`;
    }
    return blocks(escapeHtml(part).split("\n"));
  }).join("");
}
