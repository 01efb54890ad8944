// Small DOM and formatting helpers shared by the views. Data from the API is only ever
// inserted as text (never as HTML), so a job name or log line cannot inject markup.

/** h("a", {href: "#/"}, "text", child) -> element. `on*` attrs become listeners. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "text") el.textContent = v;
    else if (v === true) el.setAttribute(k, "");
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
export const STATES = [
  "PENDING", "STARTING", "RUNNING", "RECOVERING", "RESIZING", "SUCCEEDED", "FAILED", "CANCELLED",
];

export function badge(state) {
  return h("span", { class: `badge badge-${String(state).toLowerCase()}`, "data-state": state }, state);
}

export function parseTime(t) {
  if (t === null || t === undefined) return null;
  if (typeof t === "number") return t > 1e12 ? t : t * 1000; // epoch s or ms
  // Naive ISO strings (no zone) from the API are UTC.
  const s = /[zZ]|[+-]\d\d:?\d\d$/.test(t) ? t : `${t}Z`;
  const ms = Date.parse(s);
  return Number.isNaN(ms) ? null : ms;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hr = Math.floor(m / 60);
  if (hr < 48) return `${hr}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hr / 24)}d ${hr % 24}h`;
}

export function fmtAge(t, now = Date.now()) {
  const ms = parseTime(t);
  return ms === null ? "—" : fmtDuration((now - ms) / 1000);
}

export function fmtDateTime(t) {
  const ms = parseTime(t);
  if (ms === null) return "—";
  const d = new Date(ms);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtNum(x, digits = 4) {
  if (x === null || x === undefined || !Number.isFinite(Number(x))) return "—";
  const n = Number(x);
  if (n !== 0 && (Math.abs(n) >= 1e6 || Math.abs(n) < 1e-3)) return n.toExponential(2);
  return Number(n.toPrecision(digits)).toString();
}

export function fmtPct(fraction) {
  if (fraction === null || fraction === undefined || !Number.isFinite(Number(fraction))) return "—";
  return `${(Number(fraction) * 100).toFixed(1)}%`;
}

export function fmtRate(x) {
  if (x === null || x === undefined || !Number.isFinite(Number(x))) return "—";
  const n = Number(x);
  if (n >= 1e6) return `${(n / 1e6).toFixed(2)}M`;
  if (n >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
  return n.toFixed(n >= 100 ? 0 : 1);
}

export function fmtBytes(b) {
  if (b === null || b === undefined || !Number.isFinite(Number(b))) return "—";
  let n = Number(b);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i === 0 ? n : n.toFixed(n >= 100 ? 0 : 1)} ${units[i]}`;
}

/**
 * Run `fn` now and then every `intervalMs` after it settles (never overlapping), paused
 * while the tab is hidden. Returns {stop, kick}; `kick()` runs it again right away.
 */
export function poll(fn, intervalMs) {
  let timer = null;
  let running = false;
  let stopped = false;
  let again = false;
  const schedule = () => {
    clearTimeout(timer);
    if (!stopped) timer = setTimeout(tick, intervalMs);
  };
  async function tick() {
    if (stopped) return;
    if (document.hidden) { schedule(); return; }
    if (running) { again = true; return; }
    running = true;
    try { await fn(); } catch (e) { console.warn("poll:", e); } finally { running = false; }
    if (again) { again = false; tick(); } else schedule();
  }
  const onVisible = () => { if (!document.hidden) tick(); };
  document.addEventListener("visibilitychange", onVisible);
  tick();
  return {
    stop() { stopped = true; clearTimeout(timer); document.removeEventListener("visibilitychange", onVisible); },
    kick() { clearTimeout(timer); tick(); },
  };
}

export function toast(message, kind = "info", ms = 4000) {
  const box = document.getElementById("toasts");
  const el = h("div", { class: `toast toast-${kind}` }, message);
  box.append(el);
  setTimeout(() => el.remove(), ms);
}

/** A labelled empty/placeholder row for tables. */
export function emptyRow(cols, text) {
  return h("tr", { class: "empty" }, h("td", { colspan: cols }, text));
}

/** Expose numbers for tests and benchmarks (window.__elastrain). */
export const debug = (window.__elastrain = window.__elastrain || { perf: {}, charts: {} });
