// The job page (#/jobs/ID): goodput (where the wall time went), live curves, world size
// with markers, where each start or recovery spent its seconds, the event timeline,
// checkpoints, a log tail and the spec; Cancel and "Checkpoint now". Metrics are fetched
// incrementally (since_step) and appended to the charts; the rest is re-read each poll.

import { api } from "./api.js";
import { MARKERS, StepChart, WorldSizeChart, classifyEvent, markerKey } from "./charts.js";
import { goodputPanel } from "./goodput.js";
import {
  TERMINAL, badge, debug, emptyRow, fmtBytes, fmtDateTime, fmtDuration, fmtNum, fmtPct, fmtRate, h,
  parseTime, poll, toast,
} from "./util.js";

const POLL_MS = 2000;
const POLL_DONE_MS = 10000;
// Points per metrics request: about one per pixel of a wide chart, twice over.
const MAX_POINTS = 2000;
const LOG_KEEP_CHARS = 256 * 1024;
// The phases of a start after its first mark (contracts.messages.Phase), in order: a grow
// onto a node that joined starts there (its process warm, then the decision), others at
// the decision.
const PHASES = ["process_warm", "detected", "old_group_stopped", "placed", "processes_up", "group_formed", "state_restored", "first_step"];

export function mount(main, { match }) {
  const id = Number(match[1]);
  const view = new JobView(main, id);
  return () => view.destroy();
}

class JobView {
  constructor(main, id) {
    this.id = id;
    this.job = null;
    this.nextStep = 0; // metrics: ask for steps >= this
    this.metricAttempt = null;
    this.eventSig = "";
    this.ckptSig = "";
    this.events = [];
    this.checkpoints = [];
    this.logOffset = "0";
    this.logAttempt = null;
    this.recentStepTimes = [];
    this.build(main);
    this.poller = poll(() => this.refresh(), POLL_MS);
    this.onTheme = () => this.rebuildCharts();
    window.addEventListener("themechange", this.onTheme);
    this.themeQuery = matchMedia("(prefers-color-scheme: dark)");
    this.themeQuery.addEventListener("change", this.onTheme);
  }

  build(main) {
    const id = this.id;
    this.title = h("h1", { id: "job-title" }, `Job #${id}`);
    this.stateBadge = h("span", { id: "job-state" });
    this.reason = h("p", { class: "muted reason", id: "job-reason" });
    this.cancelBtn = h("button", { class: "btn btn-danger", type: "button", id: "cancel-btn", disabled: true }, "Cancel job");
    this.ckptBtn = h("button", { class: "btn", type: "button", id: "checkpoint-btn", disabled: true }, "Checkpoint now");
    this.cancelBtn.addEventListener("click", () => this.cancel());
    this.ckptBtn.addEventListener("click", () => this.checkpoint());
    this.stats = h("dl", { class: "stats", id: "job-stats" });
    this.errorBox = h("div", { class: "callout callout-bad", id: "job-error", role: "alert", hidden: true });
    this.loadError = h("p", { class: "error-text", role: "alert", hidden: true });
    this.goodput = goodputPanel();

    const lossBox = h("div", { class: "chart", id: "chart-loss" });
    const tputBox = h("div", { class: "chart", id: "chart-throughput" });
    const worldBox = h("div", { class: "chart", id: "chart-world" });
    this.lossReadout = h("span", { class: "readout mono", id: "loss-readout" });
    this.tputReadout = h("span", { class: "readout mono", id: "throughput-readout" });
    this.chartBoxes = { lossBox, tputBox, worldBox };

    this.eventsBody = h("tbody");
    this.startsBody = h("tbody");
    this.ckptBody = h("tbody");
    this.logPre = h("pre", { class: "log", id: "job-log", tabindex: "0", "aria-label": "Log tail" });
    this.logFollow = h("input", { type: "checkbox", id: "log-follow", checked: true });
    this.logFiles = h("span", { class: "muted mono small" });
    this.specPre = h("pre", { class: "spec", id: "job-spec", tabindex: "0" });

    main.append(
      h("div", { class: "page-head" },
        h("div", {},
          h("a", { href: "#/", class: "back" }, "← Jobs"),
          h("div", { class: "title-row" }, this.title, this.stateBadge),
          this.reason),
        h("div", { class: "actions" }, this.ckptBtn, this.cancelBtn)),
      this.loadError,
      this.errorBox,
      this.stats,
      this.goodput.el,
      h("div", { class: "grid-2" },
        h("section", { class: "panel", "aria-labelledby": "h-loss" },
          h("div", { class: "panel-head" }, h("h2", { id: "h-loss" }, "Loss"), this.lossReadout),
          lossBox),
        h("section", { class: "panel", "aria-labelledby": "h-tput" },
          h("div", { class: "panel-head" }, h("h2", { id: "h-tput" }, "Throughput"), this.tputReadout),
          tputBox)),
      h("section", { class: "panel", "aria-labelledby": "h-world" },
        h("div", { class: "panel-head" }, h("h2", { id: "h-world" }, "World size over time"), markerKey()),
        worldBox),
      h("section", { class: "panel", "aria-labelledby": "h-starts" },
        h("div", { class: "panel-head" }, h("h2", { id: "h-starts" }, "Starts and recoveries"),
          h("ul", { class: "marker-key", "aria-label": "Phase colours" }, ...PHASES.map((p) => h("li", {},
            h("span", { class: `swatch seg-${p}`, "aria-hidden": "true" }), phaseName(p))))),
        h("div", { class: "table-wrap" }, h("table", { class: "starts", id: "starts-table" },
          h("thead", {}, h("tr", {}, ...["Attempt", "Cause", "Took", "Phases", "State from"]
            .map((c) => h("th", { scope: "col", class: c === "Phases" ? "col-phases" : null }, c)))),
          this.startsBody))),
      h("section", { class: "panel", "aria-labelledby": "h-events" },
        h("div", { class: "panel-head" }, h("h2", { id: "h-events" }, "Events")),
        h("div", { class: "table-wrap" }, h("table", { class: "events", id: "events-table" },
          h("thead", {}, h("tr", {}, ...["Time", "Event", "Reason", "Workers", "Attempt", "Step"]
            .map((c) => h("th", { scope: "col" }, c)))),
          this.eventsBody))),
      h("div", { class: "grid-2" },
        h("section", { class: "panel", "aria-labelledby": "h-ckpt" },
          h("div", { class: "panel-head" }, h("h2", { id: "h-ckpt" }, "Checkpoints")),
          h("div", { class: "table-wrap" }, h("table", { id: "checkpoints-table" },
            h("thead", {}, h("tr", {}, ...["Step", "Attempt", "Workers", "Size", "Committed"]
              .map((c) => h("th", { scope: "col" }, c)))),
            this.ckptBody))),
        h("section", { class: "panel", "aria-labelledby": "h-spec" },
          h("div", { class: "panel-head" }, h("h2", { id: "h-spec" }, "Spec"),
            h("button", { class: "btn btn-sm", type: "button", onclick: () => this.clone() }, "Clone to submit")),
          this.specPre)),
      h("section", { class: "panel", "aria-labelledby": "h-logs" },
        h("div", { class: "panel-head" }, h("h2", { id: "h-logs" }, "Logs"), this.logFiles,
          h("label", { class: "inline" }, this.logFollow, " follow")),
        this.logPre),
    );
    this.buildCharts();
  }

  buildCharts() {
    const { lossBox, tputBox, worldBox } = this.chartBoxes;
    const marks = () => this.stepMarks || [];
    this.lossChart = new StepChart(lossBox, {
      id: "loss", yLabel: "loss", getMarks: marks,
      series: [
        { key: "loss", label: "loss", colorVar: "--accent", fmt: (v) => fmtNum(v, 5) },
        { key: "eval_loss", label: "held-out", colorVar: "--accent-2", fmt: (v) => fmtNum(v, 5), sparse: true },
      ],
    });
    // tokens/s is samples/s times the sequence length: one curve, both in the readout.
    // MFU on the right axis where the device's peak is known (GPUs; a CPU only when the
    // operator set ELASTRAIN_PEAK_FLOPS): model FLOPs per second over that peak.
    this.tputChart = new StepChart(tputBox, {
      id: "throughput", yLabel: "samples/s", y2Label: "MFU", getMarks: marks,
      series: [
        { key: "samples_per_s", label: "samples/s", colorVar: "--accent-2", fmt: fmtRate },
        { key: "mfu", label: "MFU", colorVar: "--accent", scale: "y2", fmt: fmtPct },
      ],
    });
    this.worldChart = new WorldSizeChart(worldBox);
  }

  rebuildCharts() {
    for (const c of [this.lossChart, this.tputChart]) c.build();
    this.worldChart.build();
    this.drawWorld();
  }

  async refresh() {
    const id = this.id;
    let job;
    try {
      job = await api.job(id);
    } catch (e) {
      this.loadError.hidden = false;
      this.loadError.textContent = e.status === 404 ? `Job #${id} does not exist.` : e.message;
      return;
    }
    this.loadError.hidden = true;
    const prev = this.job;
    this.job = job;
    // A new attempt may re-report steps after its checkpoint: re-read from there.
    if (this.metricAttempt !== null && job.attempt !== this.metricAttempt) {
      const ck = this.checkpoints.find((c) => c.step < this.nextStep);
      this.nextStep = Math.min(this.nextStep, ck ? ck.step + 1 : 0);
    }
    this.metricAttempt = job.attempt;
    const [metrics, events, checkpoints, logs] = await Promise.allSettled([
      this.fetchMetrics(),
      api.events(id),
      api.checkpoints(id),
      api.logs(id, this.logOffset, this.logAttempt),
    ]);
    if (events.status === "fulfilled") this.renderEvents(events.value);
    if (checkpoints.status === "fulfilled") this.renderCheckpoints(checkpoints.value);
    if (metrics.status === "fulfilled") this.renderReadouts();
    if (logs.status === "fulfilled") this.renderLogs(logs.value);
    this.drawWorld();
    this.renderHeader(job, prev);
    this.goodput.update(job.goodput);
    if (TERMINAL.has(job.state)) this.slowDown();
  }

  async fetchMetrics() {
    // The server keeps at most MAX_POINTS per request, downsampled with the curve's shape
    // (each bucket's lowest and highest loss, slowest step, held-out loss): a job of a
    // million steps arrives as ~2,000 real points. New steps then arrive as they are.
    // When the chart has gathered twice the budget, it is read again whole, downsampled.
    const whole = this.nextStep === 0 || this.lossChart.steps.length > 2 * MAX_POINTS;
    const since = whole ? 0 : this.nextStep;
    const t0 = performance.now();
    const points = await api.metrics(this.id, since, MAX_POINTS);
    if (whole) {
      this.lossChart.reset();
      this.tputChart.reset();
      this.recentStepTimes = [];
    }
    if (!points.length) return;
    this.lossChart.append(points);
    this.tputChart.append(points);
    for (const p of points) {
      if (p.step_time_s != null) this.recentStepTimes.push(Number(p.step_time_s));
    }
    this.lastPoint = points[points.length - 1];
    // Where the MFU's peak comes from (or why there is none): sent with an attempt's first step.
    for (const p of points) if (p.mfu_basis) this.mfuBasis = p.mfu_basis;
    if (this.recentStepTimes.length > 50) this.recentStepTimes.splice(0, this.recentStepTimes.length - 50);
    this.nextStep = points[points.length - 1].step + 1;
    debug.perf.metrics = { points: points.length, ms: performance.now() - t0, total: this.lossChart.steps.length };
  }

  slowDown() {
    if (this.slowed) return;
    this.slowed = true;
    this.poller.stop();
    this.poller = poll(() => this.refresh(), POLL_DONE_MS);
  }

  renderHeader(job, prev) {
    const spec = job.spec || {};
    const scaling = spec.scaling || {};
    this.title.textContent = `#${job.id} ${job.name}`;
    document.title = `#${job.id} ${job.name} · elastrain`;
    if (!prev || prev.state !== job.state) this.stateBadge.replaceChildren(badge(job.state));
    const extras = [];
    if (job.cancel_requested && !TERMINAL.has(job.state)) extras.push("cancel requested");
    if (job.checkpoint_requested) extras.push("checkpoint requested");
    this.reason.textContent = [job.state_reason, ...extras].filter(Boolean).join(" · ");
    const terminal = TERMINAL.has(job.state);
    this.cancelBtn.disabled = terminal || (job.cancel_requested && job.state !== "PENDING");
    this.ckptBtn.disabled = !["STARTING", "RUNNING", "RECOVERING", "RESIZING"].includes(job.state) || job.checkpoint_requested;
    this.ckptBtn.title = this.ckptBtn.disabled && !job.checkpoint_requested ? "Only while the job is running" : "";

    const maxSteps = job.max_steps || 0;
    const pct = maxSteps ? Math.min(100, (100 * job.step) / maxSteps) : 0;
    const eta = this.eta(job);
    const started = parseTime(job.started_at);
    const end = parseTime(job.finished_at) || Date.now();
    const stat = (label, ...value) => [h("div", { class: "stat" }, h("dt", {}, label), h("dd", {}, ...value))];
    const bar = (fraction) => h("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(100 * fraction) },
      h("div", { class: `bar bar-${job.state.toLowerCase()}`, style: `width:${(100 * fraction).toFixed(1)}%` }));
    const etaText = (seconds) => terminal ? "" : seconds == null ? "  ETA —" : `  ETA ${fmtDuration(seconds)}`;
    // A prepare job's steps are progress points: its progress is input bytes, files and rows.
    const prep = spec.workload?.name === "prepare" ? this.lastPoint || {} : null;
    this.stats.replaceChildren(
      ...(prep ? [
        ...stat("Progress", bar(job.state === "SUCCEEDED" ? 1 : Number(prep.progress ?? 0)),
          h("span", { class: "num", id: "stat-files" }, `files ${prep.files_done ?? 0} / ${prep.files ?? "?"}`),
          h("span", { class: "muted", id: "stat-prepare-eta" }, etaText(prep.eta_s))),
        ...stat("Read", h("span", { class: "num", id: "stat-rows" }, `${Number(prep.rows ?? 0).toLocaleString()} rows`),
          h("span", { class: "muted", id: "stat-bytes" }, ` · ${fmtBytes(Number(prep.bytes ?? 0))}`)),
        ...stat("Tokens", h("span", { class: "num big", id: "stat-tokens" }, Number(prep.tokens ?? 0).toLocaleString())),
      ] : [
        ...stat("Progress", bar(pct / 100),
          h("span", { class: "num", id: "stat-step" }, `${job.step.toLocaleString()} / ${maxSteps.toLocaleString()}`),
          h("span", { class: "muted" }, etaText(eta))),
        ...stat("Workers", h("span", { class: "num big", id: "stat-world" }, job.world_size ?? "—"),
          h("span", { class: "muted" }, ` of ${scaling.min_workers ?? "?"}..${scaling.max_workers ?? "?"}`)),
        ...stat("Latest loss", h("span", { class: "num big", id: "stat-loss" }, fmtNum(job.latest_loss, 5))),
      ]),
      ...stat("Strategy", h("span", {}, strategyText(spec, job.strategy))),
      ...stat("Attempt", h("span", { class: "num" }, `${job.attempt}`),
        h("span", { class: "muted" }, ` · ${job.restarts} restart${job.restarts === 1 ? "" : "s"}`)),
      ...stat("Running for", h("span", { class: "num" }, started ? fmtDuration((end - started) / 1000) : "—")),
      ...stat("Created", h("span", { class: "num", title: job.created_at }, fmtDateTime(job.created_at))),
      ...stat("Owner · priority", h("span", {}, `${job.owner} · ${job.priority}`)),
      ...stat("Labels", ...Object.entries(job.labels || {}).map(([k, v]) => h("span", { class: "chip" }, `${k}:${v}`))),
    );
    if (job.last_error) {
      this.errorBox.hidden = false;
      this.errorBox.replaceChildren(h("strong", {}, "Last error"), h("pre", {}, job.last_error));
    } else this.errorBox.hidden = true;
    const specText = JSON.stringify(spec, null, 2);
    if (this.specPre.textContent !== specText) this.specPre.textContent = specText;
  }

  eta(job) {
    if (TERMINAL.has(job.state) || !job.max_steps || job.step >= job.max_steps) return null;
    const times = this.recentStepTimes.slice(-20);
    if (!times.length) return null;
    const mean = times.reduce((a, b) => a + b, 0) / times.length;
    return mean * (job.max_steps - job.step);
  }

  pointsText() {
    const drawn = this.lossChart.steps.length;
    const steps = this.job ? this.job.step : 0;
    // Fewer points than steps: the server kept the curve's shape in MAX_POINTS.
    if (steps > drawn) return `${drawn.toLocaleString()} points of ${steps.toLocaleString()} steps`;
    return `${drawn.toLocaleString()} points`;
  }

  renderReadouts() {
    const loss = this.lossChart.last("loss");
    const held = this.lossChart.last("eval_loss");
    this.lossReadout.textContent = loss === null ? "" : [
      `last ${fmtNum(loss, 5)}`,
      held === null ? "" : `held-out ${fmtNum(held, 5)}`,
      this.pointsText(),
    ].filter(Boolean).join(" · ");
    this.lossReadout.dataset.last = loss ?? "";
    const p = this.lastPoint || {};
    this.tputReadout.textContent = [
      p.samples_per_s != null ? `${fmtRate(p.samples_per_s)} samples/s` : "",
      p.tokens_per_s != null ? `${fmtRate(p.tokens_per_s)} tokens/s` : "",
      p.step_time_s != null ? `${Math.round(p.step_time_s * 1000)} ms/step` : "",
      p.mfu != null ? `MFU ${fmtPct(p.mfu)}` : "",
      p.mfu == null && p.model_flops_per_s != null ? `${fmtNum(p.model_flops_per_s / 1e9, 3)} GFLOP/s per rank` : "",
    ].filter(Boolean).join(" · ");
    this.tputReadout.title = this.mfuBasis ? `MFU: ${this.mfuBasis}` : "";
  }

  renderEvents(events) {
    const sig = events.length ? `${events.length}:${events[events.length - 1].id}` : "0";
    if (sig === this.eventSig) return;
    this.eventSig = sig;
    this.events = events;
    // Markers on the step charts: where training was interrupted, resized or resumed.
    // One line per step, the most severe kind winning (a node loss outranks the resume).
    const rank = ["node_lost", "failure", "straggler", "resize", "resume"];
    const byStep = new Map();
    for (const e of events) {
      const type = classifyEvent(e);
      if (!rank.includes(type) || e.step == null) continue;
      const had = byStep.get(e.step);
      if (!had || rank.indexOf(type) < rank.indexOf(had)) byStep.set(e.step, type);
    }
    this.stepMarks = [...byStep].map(([x, type]) => ({ x, type }));
    this.lossChart.redraw();
    this.tputChart.redraw();
    this.renderStarts(events.filter((e) => e.kind === "timeline"));
    if (!events.length) { this.eventsBody.replaceChildren(emptyRow(6, "No events yet.")); return; }
    // Newest first: the timeline is read from what just happened.
    this.eventsBody.replaceChildren(...[...events].reverse().map((e) => {
      const type = classifyEvent(e);
      const what = e.kind === "transition"
        ? h("span", { class: "transition" }, e.from_state ? badge(e.from_state) : "", e.from_state ? " → " : "", badge(e.to_state))
        : h("span", { class: "kind" }, e.kind.replaceAll("_", " "));
      const ws = e.world_size_before === e.world_size_after
        ? `${e.world_size_after ?? "—"}`
        : `${e.world_size_before ?? "—"} → ${e.world_size_after ?? "—"}`;
      const reason = h("td", { class: "reason" }, e.reason || "");
      if (e.details && Object.keys(e.details).length) {
        reason.append(h("details", {}, h("summary", {}, "details"), h("pre", {}, JSON.stringify(e.details, null, 2))));
      }
      return h("tr", { "data-event-id": e.id, "data-kind": type || e.kind },
        h("td", { class: "num nowrap", title: e.at }, type ? h("span", { class: `swatch swatch-${type}`, title: MARKERS[type].label }) : "", fmtDateTime(e.at)),
        h("td", {}, what),
        reason,
        h("td", { class: "num" }, ws),
        h("td", { class: "num" }, e.attempt),
        h("td", { class: "num" }, e.step ?? "—"));
    }));
  }

  /** One row per attempt's timeline, newest first; bars share one scale (the slowest). */
  renderStarts(timelines) {
    if (!timelines.length) { this.startsBody.replaceChildren(emptyRow(5, "No starts recorded yet")); return; }
    const scale = Math.max(...timelines.map((e) => Number(e.details?.total_s) || 0)) || 1;
    this.startsBody.replaceChildren(...[...timelines].reverse().map((e) => {
      const d = e.details || {};
      const phases = (d.phases || []).slice(1); // the first mark is where the clock starts
      const said = (p) => `${phaseName(p.phase)}: ${Number(p.seconds).toFixed(2)} s${p.detail ? ` — ${p.detail}` : ""}`;
      const restored = phases.find((p) => p.phase === "state_restored");
      return h("tr", { "data-attempt": d.attempt ?? e.attempt },
        h("td", { class: "num" }, d.attempt ?? e.attempt),
        h("td", { class: "cause" }, d.cause ?? "—"),
        h("td", { class: "num total", title: e.reason }, `${Number(d.total_s ?? 0).toFixed(2)} s`),
        h("td", {}, h("div", { class: "phase-bar", role: "img", "aria-label": phases.map(said).join("; ") },
          ...phases.filter((p) => p.seconds > 0).map((p) => h("span", {
            class: `seg seg-${p.phase}`, title: said(p), style: `width:${((100 * p.seconds) / scale).toFixed(2)}%`,
          })))),
        h("td", { class: "restored" }, restored?.detail || "—"));
    }));
  }

  renderCheckpoints(checkpoints) {
    const sig = checkpoints.map((c) => `${c.step}@${c.committed_at}`).join(",");
    if (sig === this.ckptSig) return;
    this.ckptSig = sig;
    this.checkpoints = checkpoints;
    if (!checkpoints.length) { this.ckptBody.replaceChildren(emptyRow(5, "No checkpoints committed yet.")); return; }
    this.ckptBody.replaceChildren(...checkpoints.map((c) => h("tr", { title: c.path },
      h("td", { class: "num" }, c.step.toLocaleString()),
      h("td", { class: "num" }, c.attempt),
      h("td", { class: "num" }, c.world_size),
      h("td", { class: "num" }, fmtBytes(c.bytes)),
      h("td", { class: "num nowrap" }, fmtDateTime(c.committed_at)))));
  }

  drawWorld() {
    if (!this.job) return;
    this.worldChart.update(this.events, this.checkpoints, this.job, (t) => {
      const ms = parseTime(t);
      return ms === null ? null : ms / 1000;
    });
  }

  renderLogs(chunk) {
    // A newer attempt started: finish with this one, then follow the new one from its start.
    if (this.logAttempt === null && chunk.attempt !== null) this.logAttempt = chunk.attempt;
    this.logFiles.textContent = chunk.files && chunk.files.length
      ? `attempt ${chunk.attempt} · ${chunk.files.join(", ")}` : "";
    let text = chunk.text || "";
    if (chunk.latest_attempt !== null && chunk.latest_attempt !== undefined && this.logAttempt !== null
        && chunk.latest_attempt > this.logAttempt && !text) {
      this.logAttempt = chunk.latest_attempt;
      this.logOffset = "0";
      text = `\n──── attempt ${chunk.latest_attempt} ────\n`;
    } else {
      this.logOffset = chunk.next_offset;
    }
    if (!text) {
      if (!this.logPre.textContent) this.logPre.textContent = "(no log output yet)";
      return;
    }
    let current = this.logPre.textContent === "(no log output yet)" ? "" : this.logPre.textContent;
    current += text;
    if (current.length > LOG_KEEP_CHARS) {
      const cut = current.indexOf("\n", current.length - LOG_KEEP_CHARS);
      current = current.slice(cut + 1);
    }
    this.logPre.textContent = current;
    if (this.logFollow.checked) this.logPre.scrollTop = this.logPre.scrollHeight;
  }

  async cancel() {
    const job = this.job;
    if (!job) return;
    const ok = window.confirm(
      `Cancel job #${job.id} "${job.name}"?\n\nIts workers are stopped; committed checkpoints are kept.`);
    if (!ok) return;
    this.cancelBtn.disabled = true;
    try {
      const updated = await api.cancel(job.id);
      toast(updated.state === "CANCELLED" ? `Job #${job.id} cancelled.` : `Cancel requested for job #${job.id}.`, "ok");
    } catch (e) {
      toast(e.message, "bad", 8000);
    }
    this.poller.kick();
  }

  async checkpoint() {
    const job = this.job;
    if (!job) return;
    this.ckptBtn.disabled = true;
    try {
      await api.checkpoint(job.id);
      toast(`Checkpoint requested for job #${job.id}.`, "ok");
    } catch (e) {
      toast(e.message, "bad", 8000);
    }
    this.poller.kick();
  }

  clone() {
    if (!this.job) return;
    const spec = { ...this.job.spec, name: `${this.job.spec.name}-2`.slice(0, 100) };
    sessionStorage.setItem("elastrain.draft", JSON.stringify(spec, null, 2));
    location.hash = "#/submit";
  }

  destroy() {
    this.poller.stop();
    window.removeEventListener("themechange", this.onTheme);
    this.themeQuery.removeEventListener("change", this.onTheme);
    this.lossChart.destroy();
    this.tputChart.destroy();
    this.worldChart.destroy();
  }
}

function phaseName(phase) {
  return String(phase).replaceAll("_", " ");
}

function strategyText(spec, running) {
  const s = spec.strategy || {};
  // auto: what the memory plan chose at the current attempt's launch (the events say why).
  // tp2, fsdp+tp2, pipeline+tp2: the job's strategy field names the tensor-parallel degree.
  const fixed = running && running !== "auto" ? running : s.kind || "ddp";
  const kind = s.kind === "auto" ? `auto → ${running && running !== "auto" ? running : "not planned yet"}` : fixed;
  const extras = [s.mixed_precision, s.cpu_offload ? "cpu offload" : null].filter(Boolean);
  if (s.kind !== "pipeline") return [kind, ...extras].join(" · ");
  return [kind, `${s.pipeline_stages ?? 2} stages`, s.schedule ?? "1f1b", `${s.microbatches ?? 4} µb`, ...extras].join(" · ");
}
