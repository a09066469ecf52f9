// The chat page: a conversation kept in the page, streamed from /v1/chat/completions, each
// token coloured by where it came from (the stream's `treegraft.provenance` runs).
// Model output is Markdown rendered by marked, then always sanitised by DOMPurify into a
// fragment that may hold no image, script, style or form: text from the model can never run
// script or load anything (the server's Content-Security-Policy is a second fence).
"use strict";

const SOURCES = ["ngram", "draft", "both", "target"];
const PURIFY = {
  ALLOWED_TAGS: ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del",
                 "code", "pre", "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody",
                 "tr", "th", "td"],
  ALLOWED_ATTR: ["href", "title", "class", "start", "align"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  RETURN_DOM_FRAGMENT: true,
};

const $ = (id) => document.getElementById(id);
// The conversation, and the answer streaming now with its fetch's abort controller.
const state = { messages: [], controller: null, streaming: null };

function setUpSanitiser() {
  // Classes only name a code block's language (no model text can pose as our own markup),
  // and a link opens apart from this page, sending nothing about it.
  DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
    if (data.attrName === "class" && !/^language-[\w+#-]+$/.test(data.attrValue)) {
      data.keepAttr = false;
    }
  });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("rel", "noopener noreferrer");
      node.setAttribute("target", "_blank");
    }
  });
}

function headers() {
  const key = $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

async function errorText(resp) {
  try {
    return (await resp.json()).error.message;
  } catch {
    return `HTTP ${resp.status}`;
  }
}

async function loadConfig() {
  const resp = await fetch("/treegraft/config", { headers: headers() });
  if (!resp.ok) {
    $("model").textContent = "not connected";
    notice(resp.status === 401 ? "This server needs an API key: enter it under Settings."
                               : `Could not read the server's settings: ${await errorText(resp)}`);
    return;
  }
  const cfg = await resp.json();
  notice("");
  $("model").textContent = `model ${cfg.model}`;
  $("model-note").textContent = cfg.note || "";   // e.g. that the model is a test model
  $("model-note").hidden = !cfg.note;
  const select = $("strategy");
  const first = select.options.length === 0;   // a reload (a new key) keeps what was chosen
  const chosen = select.value;
  select.replaceChildren(...cfg.strategies.map((name) => new Option(name, name)));
  select.value = first || !cfg.strategies.includes(chosen) ? cfg.strategy : chosen;
  if (first) {
    $("temperature").value = cfg.temperature;
    $("top-p").value = cfg.top_p;
    $("max-tokens").value = cfg.max_tokens;
  }
  $("max-tokens").max = cfg.max_tokens_limit;
  $("strategy-default").textContent = `server default: ${cfg.strategy}`;
  $("temperature-default").textContent = `server default: ${cfg.temperature}`;
  $("top-p-default").textContent = `server default: ${cfg.top_p}`;
  $("max-tokens-default").textContent =
    `server default: ${cfg.max_tokens}, at most ${cfg.max_tokens_limit}`;
}

// --- rendering ------------------------------------------------------------------------------

function renderMarkdown(target, text) {
  const html = marked.parse(text, { gfm: true, breaks: false });
  target.replaceChildren(DOMPurify.sanitize(html, PURIFY));
  target.querySelectorAll("pre code").forEach((block) => hljs.highlightElement(block));
}

function owners(provenance) {
  // The source of every character of the text the runs make up, in order.
  const out = [];
  for (const [text, source] of provenance) {
    for (let i = 0; i < text.length; i++) out.push(source);
  }
  return out;
}

function colour(root, text, provenance) {
  // Wrap the rendered text in spans by source: each rendered character is matched to the
  // next equal character of the Markdown source (rendered text is, but for decoded
  // entities, a subsequence of it: rendering drops syntax and sanitising drops markup).
  const sources = owners(provenance);
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let pos = 0;
  for (const node of nodes) {
    const labels = [];
    for (const ch of node.data.split("")) {
      const at = text.indexOf(ch, pos);
      labels.push(at >= 0 ? sources[at] : undefined);
      if (at >= 0) pos = at + 1;
    }
    if (node.data.trim()) node.replaceWith(spans(node.data, labels));
  }
}

function spans(data, labels) {
  // The text as runs of equal labels: a span of class src-<source> each, plain text where
  // the source is unknown.
  const fragment = document.createDocumentFragment();
  let from = 0;
  for (let k = 1; k <= data.length; k++) {
    if (k < data.length && labels[k] === labels[from]) continue;
    const piece = data.slice(from, k);
    if (SOURCES.includes(labels[from])) {
      const span = document.createElement("span");
      span.className = `src-${labels[from]}`;
      span.textContent = piece;
      fragment.append(span);
    } else {
      fragment.append(piece);
    }
    from = k;
  }
  return fragment;
}

function figuresText(msg) {
  // While streaming (or once stopped): the running counts; after the answer: its figures.
  if (msg.error) return msg.error;
  if (msg.usage) {
    const s = msg.usage.speculative;
    return `${s.tokens_per_sec.toFixed(1)} tokens/s · ${s.mean_accepted.toFixed(2)} tokens ` +
      `per target forward · ${s.drafter_calls} drafter calls · ` +
      `${msg.usage.completion_tokens} tokens in ${s.steps} forwards (${msg.finish}, ${s.strategy})`;
  }
  if (!msg.live) return msg.stopped ? "stopped" : "";
  return `${msg.stopped ? "stopped after " : ""}${msg.live.tokens} tokens, ` +
    `${msg.live.steps} target forwards`;
}

function messageElement(msg, index) {
  const el = document.createElement("article");
  el.className = `message ${msg.role}`;
  const content = document.createElement("div");
  content.className = "content";
  el.append(content);
  if (msg.role === "assistant") {
    const figures = document.createElement("p");
    figures.className = "figures";
    const actions = document.createElement("div");
    actions.className = "actions";
    const copy = button("Copy", "copy", () => copyText(msg.content));
    const again = button("Regenerate", "regenerate", () => regenerate(index));
    actions.append(copy, again);
    el.append(figures, actions);
  }
  return el;
}

function button(label, cls, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function render(index) {
  const msg = state.messages[index];
  if (!msg) return;   // a new chat began meanwhile
  let el = $("messages").children[index];
  if (!el) {
    el = messageElement(msg, index);
    $("messages").append(el);
  }
  const content = el.querySelector(".content");
  if (msg.role === "user") {
    content.textContent = msg.content;
  } else {
    renderMarkdown(content, msg.content);
    colour(content, msg.content, msg.provenance);
    el.querySelector(".figures").textContent = figuresText(msg);
    el.classList.toggle("streaming", msg === state.streaming);
  }
  const lastEl = $("messages").lastElementChild;
  for (const b of document.querySelectorAll(".regenerate")) {
    b.hidden = state.controller !== null || b.closest("article") !== lastEl;
  }
  el.scrollIntoView({ block: "end" });
}

function renderAll() {
  $("messages").replaceChildren();
  state.messages.forEach((_, i) => render(i));
}

let frame = null;
function renderSoon(index) {
  // At most one render per animation frame while tokens stream in.
  if (frame === null) {
    frame = requestAnimationFrame(() => { frame = null; render(index); });
  }
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    notice("");
  } catch {
    notice("The browser did not allow copying; select the text instead.");
  }
}

// --- talking to the server -------------------------------------------------------------------

function requestBody() {
  const history = state.messages.filter((m) => m !== state.streaming)
    .map((m) => ({ role: m.role, content: m.content }));
  return {
    messages: history, stream: true, strategy: $("strategy").value,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
}

function events(buffer, onData) {
  // Hand every complete server-sent event's data to onData; return what is left incomplete.
  const parts = buffer.split("\n\n");
  for (const part of parts.slice(0, -1)) {
    if (part.startsWith("data: ")) onData(part.slice(6));
  }
  return parts[parts.length - 1];
}

function take(msg, data) {
  if (data === "[DONE]") return;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    msg.error = `error: ${chunk.error.message}`;
    return;
  }
  const choice = chunk.choices[0];
  const extension = chunk.treegraft || {};
  msg.content += choice.delta.content || "";
  msg.provenance.push(...(extension.provenance || []));
  msg.live = { tokens: extension.tokens, steps: extension.steps };
  if (choice.finish_reason) msg.finish = choice.finish_reason;
  if (chunk.usage) msg.usage = chunk.usage;
}

async function generate() {
  const msg = { role: "assistant", content: "", provenance: [] };
  const body = requestBody();
  state.messages.push(msg);
  state.streaming = msg;
  state.controller = new AbortController();
  const index = state.messages.length - 1;
  setBusy(true);
  render(index);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!resp.ok) {
      msg.error = `error: ${await errorText(resp)}`;
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = events(buffer + decoder.decode(value, { stream: true }), (d) => take(msg, d));
      renderSoon(index);
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = `error: ${e.message}`;
  } finally {
    state.controller = null;
    state.streaming = null;
    setBusy(false);
    if (frame !== null) { cancelAnimationFrame(frame); frame = null; }
    if (state.messages[index] === msg) render(index);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  render(state.messages.length - 1);
  generate();
}

function regenerate(index) {
  if (state.controller) return;
  state.messages.splice(index);
  renderAll();
  generate();
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  $("prompt").focus();
}

function start() {
  setUpSanitiser();
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("api-key").addEventListener("change", loadConfig);
  $("colour").addEventListener("change", (e) => {
    $("messages").classList.toggle("coloured", e.target.checked);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  loadConfig();
}

document.addEventListener("DOMContentLoaded", start);
