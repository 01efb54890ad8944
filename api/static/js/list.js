// The job list (#/): one page of jobs from the server (filters and pagination are server
// side, so 1,000s of jobs cost the same as 50), polled every 2 s and patched in place.

import { api } from "./api.js";
import { fmtGoodput, fmtSeconds } from "./goodput.js";
import {
  STATES, TERMINAL, badge, debug, emptyRow, fmtAge, fmtDuration, fmtNum, h, parseTime, poll,
} from "./util.js";

const POLL_MS = 2000;
const PAGE_SIZES = [25, 50, 100];
// Per-job (time, step) samples seen by this tab, for a rate-based ETA. Survives remounts.
const progressSeen = new Map();

export function mount(main, { query }) {
  const state = {
    state: query.get("state") || "",
    label: query.get("label") || "",
    limit: PAGE_SIZES.includes(Number(query.get("limit"))) ? Number(query.get("limit")) : 50,
    page: Math.max(1, Number(query.get("page")) || 1),
  };
  const rows = new Map(); // id -> {tr, sig, ageCell, etaCell, goodputCell}

  const stateSel = h("select", { id: "f-state", name: "state" },
    h("option", { value: "" }, "All states"),
    h("option", { value: "active" }, "Active (not finished)"),
    ...STATES.map((s) => h("option", { value: s }, s)));
  stateSel.value = state.state;
  const labelIn = h("input", {
    id: "f-label", name: "label", type: "search", placeholder: "team:nlp", value: state.label,
    autocomplete: "off", spellcheck: "false",
  });
  const sizeSel = h("select", { id: "f-limit", name: "limit" },
    ...PAGE_SIZES.map((n) => h("option", { value: n }, `${n} / page`)));
  sizeSel.value = String(state.limit);

  const summary = h("span", { class: "muted", id: "list-summary", "aria-live": "polite" }, "Loading…");
  const prev = h("button", { class: "btn btn-sm", type: "button", "aria-label": "Previous page" }, "← Prev");
  const next = h("button", { class: "btn btn-sm", type: "button", "aria-label": "Next page" }, "Next →");
  const pageInfo = h("span", { class: "muted mono" });
  const tbody = h("tbody");
  const error = h("p", { class: "error-text", role: "alert", hidden: true });

  main.append(
    h("div", { class: "page-head" },
      h("h1", {}, "Jobs"),
      h("a", { class: "btn btn-primary", href: "#/submit" }, "+ Submit job")),
    h("form", { class: "filters", role: "search", "aria-label": "Filter jobs", onsubmit: (e) => e.preventDefault() },
      h("label", { for: "f-state" }, "State"), stateSel,
      h("label", { for: "f-label" }, "Label"), labelIn,
      h("label", { for: "f-limit", class: "sr-only" }, "Page size"), sizeSel,
      h("span", { class: "spacer" }), summary),
    error,
    h("div", { class: "table-wrap" },
      h("table", { class: "jobs", id: "jobs-table" },
        h("caption", { class: "sr-only" }, "Jobs, newest first"),
        h("thead", {}, h("tr", {},
          ...["ID", "Name", "State", "Strategy", "Workers", "Progress", "Loss", "Goodput", "Labels", "Age"]
            .map((c) => h("th", { scope: "col", class: `col-${c.toLowerCase()}` }, c)))),
        tbody)),
    h("nav", { class: "pager", "aria-label": "Pagination" }, prev, pageInfo, next),
  );

  const sync = () => {
    const q = new URLSearchParams();
    if (state.state) q.set("state", state.state);
    if (state.label) q.set("label", state.label);
    if (state.limit !== 50) q.set("limit", String(state.limit));
    if (state.page > 1) q.set("page", String(state.page));
    const qs = q.toString();
    history.replaceState(null, "", qs ? `#/?${qs}` : "#/");
    poller.kick();
  };
  stateSel.addEventListener("change", () => { state.state = stateSel.value; state.page = 1; sync(); });
  let labelTimer = null;
  labelIn.addEventListener("input", () => {
    clearTimeout(labelTimer);
    labelTimer = setTimeout(() => { state.label = labelIn.value.trim(); state.page = 1; sync(); }, 300);
  });
  sizeSel.addEventListener("change", () => { state.limit = Number(sizeSel.value); state.page = 1; sync(); });
  prev.addEventListener("click", () => { if (state.page > 1) { state.page--; sync(); } });
  next.addEventListener("click", () => { state.page++; sync(); });

  let ctrl = null;
  async function refresh() {
    if (ctrl) ctrl.abort();
    ctrl = new AbortController();
    const t0 = performance.now();
    const states = state.state === "active" ? STATES.filter((s) => !TERMINAL.has(s)).join(",") : state.state;
    let data;
    try {
      data = await api.listJobs(
        { state: states, label: state.label, limit: state.limit, offset: (state.page - 1) * state.limit },
        { signal: ctrl.signal });
    } catch (e) {
      if (e.name === "AbortError") return;
      error.hidden = false;
      error.textContent = e.message;
      return;
    }
    const t1 = performance.now();
    error.hidden = true;
    const pages = Math.max(1, Math.ceil(data.total / state.limit));
    if (state.page > pages && data.total > 0) { state.page = pages; sync(); return; }
    render(data);
    const t2 = performance.now();
    recordPerf(t1 - t0, t2 - t1, data);
  }

  function render(data) {
    const now = Date.now();
    const seen = new Set();
    const order = [];
    for (const job of data.items) {
      seen.add(job.id);
      let row = rows.get(job.id);
      if (!row) { row = makeRow(); rows.set(job.id, row); }
      updateRow(row, job, now);
      order.push(row.tr);
    }
    for (const [id, row] of rows) if (!seen.has(id)) { row.tr.remove(); rows.delete(id); }
    if (!order.length) {
      const filtered = state.state || state.label;
      tbody.replaceChildren(emptyRow(10, filtered ? "No jobs match these filters." : "No jobs yet."));
    } else {
      // Re-append only when the order changed (a new job arrived, a page moved).
      const current = [...tbody.children];
      if (current.length !== order.length || current.some((tr, i) => tr !== order[i])) {
        tbody.replaceChildren(...order);
      }
    }
    const from = data.total ? data.offset + 1 : 0;
    const to = data.offset + data.items.length;
    summary.textContent = `${from.toLocaleString()}–${to.toLocaleString()} of ${data.total.toLocaleString()} jobs`;
    const pages = Math.max(1, Math.ceil(data.total / state.limit));
    pageInfo.textContent = `page ${state.page} / ${pages}`;
    prev.disabled = state.page <= 1;
    next.disabled = state.page >= pages;
  }

  const poller = poll(refresh, POLL_MS);
  return () => { poller.stop(); clearTimeout(labelTimer); if (ctrl) ctrl.abort(); };
}

function makeRow() {
  const tr = h("tr");
  return { tr, sig: "", ageCell: null, etaCell: null, goodputCell: null };
}

function updateRow(row, job, now) {
  const spec = job.spec || {};
  const scaling = spec.scaling || {};
  // The job's strategy names a tensor-parallel degree (fsdp+tp2) and an auto job's choice.
  const kind = spec.strategy && spec.strategy.kind;
  const strategy = kind === "auto" ? `auto → ${job.strategy && job.strategy !== "auto" ? job.strategy : "…"}` : job.strategy || kind || "—";
  const labels = job.labels || spec.labels || {};
  const maxSteps = job.max_steps ?? (spec.training && spec.training.max_steps) ?? 0;
  const sig = JSON.stringify([job.name, job.state, job.state_reason, job.world_size, job.step,
    maxSteps, job.latest_loss, labels, strategy, scaling.min_workers, scaling.max_workers]);
  const eta = etaSeconds(job, maxSteps, now);
  const etaText = TERMINAL.has(job.state) ? "" : job.state === "PENDING" ? "queued"
    : eta === null ? "ETA —" : `ETA ${fmtDuration(eta)}`;
  if (sig !== row.sig) {
    row.sig = sig;
    row.tr.dataset.jobId = job.id;
    row.tr.dataset.state = job.state;
    const pct = maxSteps ? Math.min(100, (100 * job.step) / maxSteps) : 0;
    row.etaCell = h("span", { class: "eta muted" }, etaText);
    row.ageCell = h("td", { class: "num age", title: job.created_at }, fmtAge(job.created_at, now));
    row.goodputCell = h("td", { class: "num goodput" });
    const stateCell = h("td", { class: "col-state" }, badge(job.state));
    if (job.state_reason) stateCell.title = job.state_reason;
    row.tr.replaceChildren(
      h("td", { class: "num" }, h("a", { href: `#/jobs/${job.id}` }, `#${job.id}`)),
      h("td", { class: "name" }, h("a", { href: `#/jobs/${job.id}` }, job.name)),
      stateCell,
      h("td", {}, strategy),
      h("td", { class: "num" },
        h("span", { class: "ws" }, job.world_size ?? "—"),
        h("span", { class: "muted" }, ` / ${scaling.min_workers ?? "?"}..${scaling.max_workers ?? "?"}`)),
      h("td", { class: "progress-cell" },
        h("div", {
          class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": maxSteps,
          "aria-valuenow": job.step, "aria-label": `step ${job.step} of ${maxSteps}`,
        }, h("div", { class: `bar bar-${job.state.toLowerCase()}`, style: `width:${pct.toFixed(1)}%` })),
        h("span", { class: "num step" }, `${job.step.toLocaleString()} / ${maxSteps.toLocaleString()}`),
        " ", row.etaCell),
      h("td", { class: "num loss" }, fmtNum(job.latest_loss)),
      row.goodputCell,
      h("td", { class: "labels" }, ...Object.entries(labels).map(([k, v]) => h("span", { class: "chip" }, `${k}:${v}`))),
      row.ageCell,
    );
  } else {
    row.ageCell.textContent = fmtAge(job.created_at, now);
    row.etaCell.textContent = etaText;
  }
  // An active job's goodput moves with the clock: patched every poll, like the age, rather
  // than rebuilding the row.
  showGoodput(row.goodputCell, job.goodput);
}

function showGoodput(cell, g) {
  const text = g ? fmtGoodput(g.goodput) : "—";
  if (cell.textContent !== text) cell.textContent = text;
  cell.title = g && g.wall_s > 0
    ? `Goodput: ${fmtSeconds(g.training_s)} of ${fmtSeconds(g.wall_s)} spent on training steps the job kept`
    : "Goodput: no time recorded yet";
}

/** Seconds to max_steps from this tab's recent (time, step) samples; else from started_at. */
function etaSeconds(job, maxSteps, now) {
  if (TERMINAL.has(job.state) || !maxSteps || job.step >= maxSteps) return null;
  let samples = progressSeen.get(job.id);
  if (!samples) { samples = []; progressSeen.set(job.id, samples); }
  const last = samples[samples.length - 1];
  if (!last || last.step !== job.step) samples.push({ t: now, step: job.step });
  while (samples.length > 2 && now - samples[0].t > 120_000) samples.shift();
  if (samples.length >= 2) {
    const a = samples[0];
    const b = samples[samples.length - 1];
    const rate = (b.step - a.step) / ((b.t - a.t) / 1000);
    if (rate > 0) return (maxSteps - job.step) / rate;
  }
  const started = parseTime(job.started_at);
  if (job.state === "RUNNING" && started && job.step > 0) {
    const rate = job.step / ((now - started) / 1000);
    if (rate > 0) return (maxSteps - job.step) / rate;
  }
  return null;
}

function recordPerf(fetchMs, renderMs, data) {
  const p = (debug.perf.list = debug.perf.list || { samples: [] });
  p.samples.push({ fetchMs, renderMs, rows: data.items.length, total: data.total });
  if (p.samples.length > 500) p.samples.shift();
  p.last = p.samples[p.samples.length - 1];
  p.polls = (p.polls || 0) + 1;
}
