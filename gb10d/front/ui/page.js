// gb10d's page: the front's /ui/data as a live stream (/ui/events), read with fetch so that it can carry the
// API key (EventSource cannot send headers). No cookies: the key stays in this tab's sessionStorage.
"use strict";
const GIB = 2 ** 30;
const $ = (id) => document.getElementById(id);
let last = null;

function key() { return sessionStorage.getItem("gb10d-key") || ""; }
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key()) h.Authorization = "Bearer " + key();
  return h;
}
function gib(bytes) { return (bytes / GIB).toFixed(1) + " GiB"; }
function span(s) {
  if (s === null || s === undefined) return "–";
  s = Math.max(0, Math.round(s));
  if (s < 90) return s + " s";
  const m = Math.round(s / 60);
  return m < 90 ? m + " min" : Math.floor(m / 60) + " h " + (m % 60) + " min";
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") e.textContent = v; else if (k === "on") e.addEventListener("click", v); else e.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
}

function askKey(problem) {
  $("keyform").hidden = false;
  $("keyproblem").textContent = problem || "";
  $("link").textContent = "an API key is needed";
}
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("gb10d-key", $("key").value.trim());
  $("key").value = "";
  $("keyform").hidden = true;
  follow();
});

let reader = null;
async function follow() {
  if (reader) { try { await reader.cancel(); } catch (e) { /* already closed */ } }
  let response;
  try {
    response = await fetch("/ui/events", { headers: headers(), cache: "no-store" });
  } catch (e) {
    return retry();
  }
  if (response.status === 401) { return askKey(key() ? "That key was not accepted." : ""); }
  if (!response.ok || !response.body) return retry();
  $("link").textContent = "live";
  reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let part;
    try { part = await reader.read(); } catch (e) { break; }
    if (part.done) break;
    buffer += decoder.decode(part.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) { last = JSON.parse(data); render(last); }
    }
  }
  retry();
}
function retry() {
  $("link").textContent = "reconnecting…";
  setTimeout(follow, 2000);
}

function render(d) {
  const focused = document.activeElement && document.activeElement.id;
  renderMemory(d.memory);
  renderCards(d.cards);
  renderDecisions(d.decisions);
  if (focused && $(focused)) $(focused).focus();
}

const KINDS = { model: "held by a model", reserved: "reserved by a start, not yet taken", other: "other programs", cache: "page cache", free: "free" };
function renderMemory(m) {
  const bar = $("bar"), legend = $("legend"), short = $("short");
  bar.replaceChildren(); legend.replaceChildren(); short.replaceChildren();
  bar.hidden = !m;
  if (!m) { short.textContent = "The machine's memory is shown to a key that may use every model."; return; }
  const words = m.segments.map((s) => s.label + " " + gib(s.bytes));
  bar.setAttribute("role", "img");
  bar.dataset.total = m.total_bytes;
  bar.setAttribute("aria-label", "MemTotal " + gib(m.total_bytes) + ": " + words.join(", "));
  for (const s of m.segments) {
    const pct = (100 * s.bytes / m.total_bytes).toFixed(3) + "%";
    bar.append(el("div", { class: "seg " + s.kind, style: "width:" + pct, title: s.label + ": " + gib(s.bytes) + " (" + (100 * s.bytes / m.total_bytes).toFixed(1) + "%)", "data-bytes": s.bytes, "data-kind": s.kind }));
    legend.append(el("li", {}, el("span", { class: "sw seg " + s.kind, "aria-hidden": "true" }), s.label + ": " + gib(s.bytes)));
  }
  if (m.headroom_bytes > 0) {
    const left = (100 * (m.total_bytes - m.headroom_bytes) / m.total_bytes).toFixed(3) + "%";
    bar.append(el("div", { class: "headroom", style: "left:" + left, title: "headroom kept free: " + gib(m.headroom_bytes) }));
    legend.append(el("li", {}, "dashed line: headroom kept free, " + gib(m.headroom_bytes)));
  }
  legend.append(el("li", {}, "MemTotal: " + gib(m.total_bytes)));
  for (const f of m.shortfalls) {
    const room = Math.min(100, 100 * f.room_bytes / f.need_bytes).toFixed(1) + "%";
    short.append(el("div", { class: "short" },
      f.instance + " would not fit: its start reserves " + gib(f.need_bytes) + ", a start can count on " + gib(f.room_bytes) + " now.",
      el("div", { class: "need", title: "needs " + gib(f.need_bytes) + ", " + gib(f.room_bytes) + " can be had", "aria-hidden": "true" },
        el("div", { class: "room", style: "width:" + room }))));
  }
}

let shownCards = "";

// The cards are drawn anew only when what they show changed: drawn anew on every update (the memory bar's numbers,
// a decision), a button could be replaced between a press and its release, and the click was lost.
function renderCards(cards) {
  const drawn = JSON.stringify(cards);
  if (drawn === shownCards) {
    for (const dd of document.querySelectorAll("#cards dd[data-since]")) dd.textContent = span(Date.now() / 1000 - Number(dd.dataset.since));
    return;
  }
  shownCards = drawn;
  const box = $("cards");
  box.replaceChildren();
  for (const c of cards) {
    const id = c.instance.replace(/[^A-Za-z0-9_-]/g, "_");
    const stats = el("dl", {});
    const add = (k, v, extra) => { stats.append(el("dt", { text: k }), el("dd", { text: v, ...extra })); };
    add("uptime", c.serving_since ? span(Date.now() / 1000 - c.serving_since) : "–", c.serving_since ? { "data-since": c.serving_since } : {});
    add("restarts", c.restarts === null ? "–" : String(c.restarts));
    add("last start took", span(c.last_start_s));
    add("requests in flight", String(c.in_flight));
    add("requests held", String(c.held));
    add("tokens/s", c.tokens_per_s === null ? "–" : c.tokens_per_s.toFixed(1));
    add("time to first token", c.ttft_s === null ? "–" : (c.ttft_s * 1000).toFixed(0) + " ms");
    const card = el("article", { class: "card", "aria-labelledby": "t-" + id, "data-instance": c.instance, "data-state": c.state },
      el("h3", { id: "t-" + id, text: c.models.join(", ") }),
      el("p", { class: "inst", text: "instance " + c.instance }),
      el("p", {}, el("span", { class: "state " + c.state.replace(/ /g, "-"), text: c.state }), c.detail && c.detail !== c.state ? " — " + c.detail : ""));
    if (c.progress) {
      card.append(el("label", { for: "p-" + id, text: "loading weights " + c.progress[0] + "/" + c.progress[1] }),
        el("progress", { id: "p-" + id, max: c.progress[1], value: c.progress[0] }));
    }
    if (c.eta) card.append(el("p", { class: "eta", text: c.eta }));
    if (c.failure) {
      card.append(el("div", { class: "failure" }, el("p", {}, el("strong", { text: "Failed: " }), c.failure), c.fix ? el("p", {}, el("strong", { text: "Fix: " }), c.fix) : null));
    }
    card.append(stats);
    card.append(el("div", { class: "actions" },
      el("button", { id: "wake-" + id, type: "button", disabled: !c.can_wake, "aria-label": "Wake " + c.instance, on: () => act(c.instance, "wake"), text: "Wake" }),
      el("button", { id: "park-" + id, type: "button", disabled: !c.can_park, "aria-label": "Park " + c.instance, on: () => act(c.instance, "park"), text: "Park" }),
      el("button", { id: "restart-" + id, type: "button", disabled: !c.can_restart, "aria-label": "Restart " + c.instance,
        on: () => { if (confirm("Restart " + c.instance + "? Requests in flight on it are cut.")) act(c.instance, "restart"); }, text: "Restart" })));
    card.append(el("div", { class: "curl" },
      el("code", { id: "c-" + id, text: c.curl }),
      el("button", { id: "copy-" + id, type: "button", "aria-label": "Copy the curl command for " + c.models[0], on: () => copy(c.curl), text: "Copy" })));
    box.append(card);
  }
}

function renderDecisions(list) {
  const box = $("decisions");
  box.replaceChildren();
  for (const d of list.slice().reverse()) {
    const level = d.level <= 3 ? ["err", "error"] : d.level === 4 ? ["warn", "warning"] : ["", ""];
    box.append(el("li", {},
      el("time", { datetime: new Date(d.at * 1000).toISOString(), text: new Date(d.at * 1000).toLocaleTimeString() }), " ",
      el("span", { class: "who", text: d.who + ":" }), " ",
      level[1] ? el("span", { class: "lvl " + level[0], text: level[1] + ": " }) : null, d.line));
  }
}

async function act(instance, action) {
  $("said").textContent = "asking " + instance + " to " + action + "…";
  try {
    const r = await fetch("/ui/actions/" + encodeURIComponent(instance) + "/" + action, { method: "POST", headers: headers({ "x-gb10d-page": "1" }) });
    const body = await r.json();
    $("said").textContent = r.ok ? "asked " + instance + " to " + action : (body.error && body.error.message) || ("refused: " + r.status);
    if (r.status === 401) askKey("That key was not accepted.");
  } catch (e) {
    $("said").textContent = "the front did not answer";
  }
}

async function copy(text) {
  try { await navigator.clipboard.writeText(text); $("said").textContent = "copied"; }
  catch (e) { $("said").textContent = "select the command and copy it"; }
}

setInterval(() => { if (last) render(last); }, 30000);
follow();
