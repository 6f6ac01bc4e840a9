// The chat page: a thin client of the server's own /v1/chat/completions, streamed.
// The conversation lives in this tab's memory only; the settings are kept in localStorage and the
// API key (when the server asks for one) in sessionStorage, so it is gone when the tab closes.
"use strict";

const SETTINGS_KEY = "jaxserve-chat-settings";
const API_KEY_KEY = "jaxserve-api-key";
// Every setting starts empty: an empty box is left out of the request, and the server applies its own
// default (the model's, from its generation config), which the box's placeholder shows.
const DEFAULT_SETTINGS = { systemPrompt: "", temperature: "", topP: "", maxTokens: "", seed: "" };
const SETTING_INPUTS = { systemPrompt: "system-prompt", temperature: "temperature", topP: "top-p",
                         maxTokens: "max-tokens", seed: "seed" };
const SETTINGS_VERSION = 2;  // 1 (unmarked): the page filled in temperature 0.7 and top_p 0.95 itself
// The boxes whose placeholders show the server's defaults (/server_info), and what a request gets
// where the server has none (vLLM's neutral values).
const SERVER_DEFAULTS = { temperature: ["temperature", "1"], top_p: ["top-p", "1"],
                          max_tokens: ["max-tokens", "all that fits"] };

const $ = (id) => document.getElementById(id);
const conversation = $("conversation");
const prompt = $("prompt");

const chat = {
  messages: [],       // [{role, content}] as sent to the server; the system prompt is added per request
  controller: null,   // the AbortController of the reply being streamed, or null
  model: null,
  apiKey: sessionStorage.getItem(API_KEY_KEY) || "",
};

// ---------------------------------------------------------------------------------------------
// Markdown: replies are model output, so raw HTML is shown as text, links are only http(s) or
// mailto, and images become links (nothing loads by itself). The page's Content-Security-Policy
// backs this up.

const SAFE_URL = /^(https?:|mailto:)/i;

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function highlighted(code, lang, final) {
  const language = (lang || "").trim().split(/\s+/)[0];
  if (language && hljs.getLanguage(language)) {
    return { html: hljs.highlight(code, { language, ignoreIllegals: true }).value, language };
  }
  // Guessing the language runs every grammar: only once the reply is complete.
  return final ? { html: hljs.highlightAuto(code).value, language: "" } : { html: escapeHtml(code), language: "" };
}

function renderMarkdown(text, final) {
  const renderer = {
    html: ({ text: raw }) => escapeHtml(raw),
    link({ href, title, tokens }) {
      const inner = this.parser.parseInline(tokens);
      if (!SAFE_URL.test(href)) return inner;
      const titled = title ? ` title="${escapeHtml(title)}"` : "";
      return `<a href="${escapeHtml(href)}"${titled} target="_blank" rel="noopener noreferrer">${inner}</a>`;
    },
    image({ href, text: alt }) {
      const label = escapeHtml(alt || href);
      return SAFE_URL.test(href) ? `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${label}</a>` : label;
    },
    code({ text: code, lang }) {
      const { html, language } = highlighted(code, lang, final);
      const label = language ? `<span class="code-lang">${escapeHtml(language)}</span>` : "";
      return `<div class="code">${label}<pre><code class="hljs">${html}</code></pre></div>`;
    },
  };
  return new marked.Marked({ gfm: true, renderer }).parse(text);
}

// ---------------------------------------------------------------------------------------------
// The conversation's view

function clearHint() {
  const hint = $("empty-hint");
  if (hint) hint.remove();
}

function showEmptyHint(text) {
  conversation.replaceChildren();
  const hint = document.createElement("p");
  hint.id = "empty-hint";
  hint.className = "hint";
  hint.textContent = text;
  conversation.append(hint);
}

function readyHint() {
  return `Ask ${chat.model || "the model"} anything. The conversation stays in this tab.`;
}

function isNearBottom() {
  return conversation.scrollHeight - conversation.scrollTop - conversation.clientHeight < 80;
}

function scrollDown(force) {
  if (force || isNearBottom()) conversation.scrollTop = conversation.scrollHeight;
}

function addMessage(role, text) {
  clearHint();
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const heading = document.createElement("h2");
  heading.className = "visually-hidden";
  heading.textContent = role === "user" ? "You said:" : "The model said:";
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text;
  article.append(heading, body);
  conversation.append(article);
  scrollDown(true);
  return article;
}

function addStats(article, text, extraClass) {
  const stats = document.createElement("p");
  stats.className = `stats ${extraClass || ""}`.trim();
  stats.textContent = text;
  article.append(stats);
}

function addError(article, message) {
  const error = document.createElement("p");
  error.className = "error";
  error.setAttribute("role", "alert");
  error.textContent = message;
  article.append(error);
  scrollDown(true);
}

// ---------------------------------------------------------------------------------------------
// Settings

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}"); } catch { saved = {}; }
  if (saved.version !== SETTINGS_VERSION && saved.temperature === "0.7" && saved.topP === "0.95") {
    // The old page's own defaults, saved as if they were the user's: the server's apply instead.
    delete saved.temperature;
    delete saved.topP;
  }
  const settings = { ...DEFAULT_SETTINGS, ...saved };
  for (const [name, id] of Object.entries(SETTING_INPUTS)) $(id).value = settings[name];
}

function saveSettings() {
  const settings = { version: SETTINGS_VERSION };
  for (const [name, id] of Object.entries(SETTING_INPUTS)) settings[name] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

// The request's sampling fields; an empty box leaves the server's default. Bad values go to the
// server as typed, and its 400 says what is wrong.
function samplingFields() {
  const fields = {};
  const numbers = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
  for (const [field, id] of Object.entries(numbers)) {
    const value = $(id).value.trim();
    if (value !== "") fields[field] = Number(value);
  }
  return fields;
}

// ---------------------------------------------------------------------------------------------
// Talking to the server

class ServerError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (chat.apiKey) h.Authorization = `Bearer ${chat.apiKey}`;
  return h;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch { /* not JSON: keep the status line */ }
  return new ServerError(message, response.status);
}

// The `data:` payloads of a server-sent event stream, parsed, up to [DONE].
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const payload = line.slice(5).trim();
          if (payload === "[DONE]") return;
          yield JSON.parse(payload);
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function statsLine(numTokens, exact, startedAt, firstAt, endedAt, ending) {
  const parts = [`${exact ? "" : "~"}${numTokens} token${numTokens === 1 ? "" : "s"}`];
  if (firstAt !== null) {
    parts.push(`first token ${((firstAt - startedAt) / 1000).toFixed(2)} s`);
    // The decode rate: tokens after the first over the time after it (the first one's time is above).
    const seconds = (endedAt - firstAt) / 1000;
    if (numTokens > 1 && seconds > 0) parts.push(`${((numTokens - 1) / seconds).toFixed(1)} tokens/s`);
  }
  if (ending) parts.push(ending);
  return parts.join(" · ");
}

async function send(text) {
  if (chat.controller || !text.trim()) return;
  const messages = chat.messages;  // "New chat" during the reply swaps in a new list; this turn stays in the old
  messages.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const article = addMessage("assistant");
  const body = article.querySelector(".body");
  article.setAttribute("aria-busy", "true");
  body.classList.add("pending");

  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const system = $("system-prompt").value.trim();
  const request = {
    model: chat.model || undefined,
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
    ...samplingFields(),
  };

  let reply = "", numChunks = 0, usage = null, finishReason = null, firstAt = null, error = null, stopped = false;
  let renderQueued = false;
  const render = (final) => {
    body.innerHTML = renderMarkdown(reply, final);
    scrollDown(false);
  };
  const startedAt = performance.now();
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal,
    });
    if (!response.ok) throw await errorOf(response);
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new ServerError(event.error.message, event.error.code);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (firstAt === null) {
            firstAt = performance.now();
            body.classList.remove("pending");
          }
          reply += delta;
          numChunks += 1;
          if (!renderQueued) {
            renderQueued = true;
            requestAnimationFrame(() => { renderQueued = false; render(false); });
          }
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else error = e;
  }
  const endedAt = performance.now();
  chat.controller = null;
  body.classList.remove("pending");
  render(true);
  article.setAttribute("aria-busy", "false");

  if (reply) {
    messages.push({ role: "assistant", content: reply });
  } else if (error || stopped) {
    // Nothing came back: drop the turn from what the next request sends, and give the text back.
    messages.pop();
    question.classList.add("failed");
    body.remove();
    if (!prompt.value && messages === chat.messages) prompt.value = text;
  }
  if (error) {
    addError(article, error.message || String(error));
    if (error.status === 401) askForKey("The server refused the key.");
  } else if (stopped && !reply) {
    addStats(article, "Stopped before the first token.");
  }
  if (reply) {
    const ending = stopped ? "stopped" : finishReason === "length" ? "cut at max_tokens" : "";
    // Without a usage chunk (stopped, failed) the count is of streamed chunks, about one per token.
    const numTokens = usage ? usage.completion_tokens : numChunks;
    addStats(article, statsLine(numTokens, usage !== null, startedAt, firstAt, endedAt, ending),
             stopped ? "stopped" : "");
  }
  setBusy(false);
  scrollDown(false);
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function setBusy(busy) {
  const lost = [document.body, $("send"), $("stop")].includes(document.activeElement);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  // Typing goes on while a reply streams (Esc or the Stop button stops it); focus that a hidden
  // button held goes back to the message box.
  if (lost) prompt.focus();
}

// ---------------------------------------------------------------------------------------------
// The API key, and finding out which model is served

async function loadModel() {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    showEmptyHint(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (response.status === 401) {
    showEmptyHint("This server needs an API key.");
    askForKey(chat.apiKey ? "The server refused the key." : "");
    return;
  }
  if (!response.ok) {
    showEmptyHint(`The server answered: ${(await errorOf(response)).message}`);
    return;
  }
  const body = await response.json();
  chat.model = body.data && body.data[0] ? body.data[0].id : null;
  $("model-name").textContent = chat.model || "";
  document.title = chat.model ? `${chat.model} · jaxserve chat` : "jaxserve chat";
  if (!chat.messages.length) showEmptyHint(readyHint());
  loadServerDefaults();
}

// The placeholders of the sampling boxes: the defaults a request that leaves them out gets.
async function loadServerDefaults() {
  let defaults;
  try {
    const response = await fetch("server_info", { headers: headers() });
    if (!response.ok) return;
    defaults = (await response.json()).default_sampling_params;
  } catch { return; }
  if (!defaults) return;
  for (const [field, [id, neutral]] of Object.entries(SERVER_DEFAULTS)) {
    $(id).placeholder = `default: ${defaults[field] ?? neutral}`;
  }
}

function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("api-key").value = "";
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
}

// ---------------------------------------------------------------------------------------------
// Wiring

function autoGrow() {
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, window.innerHeight * 0.4)}px`;
}

function submitPrompt() {
  const text = prompt.value;
  if (!text.trim() || chat.controller) return;
  prompt.value = "";
  autoGrow();
  send(text);
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); submitPrompt(); });
prompt.addEventListener("input", autoGrow);
prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    submitPrompt();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && chat.controller && !document.querySelector("dialog[open]")) stop();
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  stop();
  chat.messages = [];
  showEmptyHint(readyHint());
  prompt.value = "";
  autoGrow();
  prompt.focus();
});
$("open-settings").addEventListener("click", () => $("settings").showModal());
$("settings").addEventListener("close", () => { saveSettings(); prompt.focus(); });
$("reset-settings").addEventListener("click", () => {
  localStorage.removeItem(SETTINGS_KEY);
  loadSettings();
});
$("key-dialog").addEventListener("cancel", (e) => e.preventDefault());  // nothing works without it
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  chat.apiKey = $("api-key").value.trim();
  sessionStorage.setItem(API_KEY_KEY, chat.apiKey);
  $("key-dialog").close();
  loadModel();
});

loadSettings();
loadModel();
