// Charts on top of the vendored uPlot (window.uPlot, loaded by index.html): line charts
// keyed by training step, and a world-size-over-time chart with event markers. Colours
// come from CSS variables so both themes read well; charts follow their box's width.

import { debug, h } from "./util.js";

/** What a job event means for the markers (null: not drawn). */
export function classifyEvent(ev) {
  const kind = String(ev.kind || "transition").toLowerCase();
  const reason = String(ev.reason || "").toLowerCase();
  const nodeLoss = /node[\s_-]*(lost|loss|died|dead|down|removed|failure|failed)|lost (a )?node/;
  // Before the reason tests: a timeline's reason names its cause ("node lost -> ...").
  if (kind === "timeline") return "first_step";
  if (kind === "straggler") return "straggler";
  if (kind !== "transition") {
    if (nodeLoss.test(kind) || nodeLoss.test(reason)) return "node_lost";
    if (/resiz|scale|grow|shrink/.test(kind)) return "resize";
    return null;
  }
  if (ev.to_state === "RECOVERING") return nodeLoss.test(reason) ? "node_lost" : "failure";
  if (ev.to_state === "RESIZING") return "resize";
  if (ev.to_state === "RUNNING" && (ev.attempt > 1 || ev.from_state === "RECOVERING" || ev.from_state === "RESIZING")) {
    return "resume";
  }
  return null;
}

export const MARKERS = {
  node_lost: { label: "node lost", cssVar: "--c-bad" },
  failure: { label: "worker failure", cssVar: "--c-warn-strong" },
  straggler: {
    label: "straggler", cssVar: "--c-warn-strong", ring: true,
    hint: "A rank slower than its peers (failure.stragglers): the event names it and its node",
  },
  resize: { label: "resize", cssVar: "--c-warn" },
  resume: { label: "resume", cssVar: "--c-good" },
  checkpoint: { label: "checkpoint", cssVar: "--c-info" },
  first_step: {
    label: "first step (timeline)", cssVar: "--accent-2", ring: true,
    hint: "Where a start or recovery ended: the attempt's first step (see Starts and recoveries)",
  },
};

/** When a timeline event's attempt made its first step (epoch seconds), else null. */
export function firstStepAt(ev) {
  const phases = (ev.details && ev.details.phases) || [];
  const last = phases[phases.length - 1];
  return last && last.phase === "first_step" && Number.isFinite(last.at) ? last.at : null;
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function axisStyle() {
  const text = cssVar("--fg-muted");
  const grid = cssVar("--grid");
  return {
    stroke: text,
    grid: { stroke: grid, width: 1 },
    ticks: { stroke: grid, width: 1 },
    font: "11px ui-monospace, \"DejaVu Sans Mono\", Menlo, Consolas, monospace",
  };
}

/** A uPlot plugin drawing dashed vertical lines at x positions from `getMarks()`. */
function markerLines(getMarks) {
  return {
    hooks: {
      draw: [(u) => {
        const marks = getMarks();
        if (!marks.length) return;
        const { ctx } = u;
        const { top, height } = u.bbox;
        ctx.save();
        ctx.lineWidth = Math.max(1, devicePixelRatio);
        ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
        for (const m of marks) {
          const x = Math.round(u.valToPos(m.x, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.strokeStyle = cssVar(MARKERS[m.type].cssVar);
          ctx.beginPath();
          ctx.moveTo(x, top);
          ctx.lineTo(x, top + height);
          ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

function fitWidth(box) {
  return Math.max(280, Math.floor(box.clientWidth || box.getBoundingClientRect().width || 600));
}

/**
 * A chart of metric series against the training step, fed incrementally.
 * series: [{key, label, colorVar, scale?, fmt?}] (key is the metric field name).
 */
export class StepChart {
  constructor(box, { id, series, height = 220, yLabel = "", y2Label = "", getMarks = () => [] }) {
    this.box = box;
    this.id = id;
    this.series = series;
    this.height = height;
    this.yLabel = yLabel;
    this.y2Label = y2Label;
    this.getMarks = getMarks;
    this.steps = [];
    this.cols = series.map(() => []);
    this.index = new Map(); // step -> position
    this.plot = null;
    this.observer = new ResizeObserver(() => {
      if (this.plot) this.plot.setSize({ width: fitWidth(this.box), height: this.height });
    });
    this.observer.observe(box);
    this.build();
    debug.charts[id] = this;
  }

  build() {
    if (this.plot) this.plot.destroy();
    const ax = axisStyle();
    const hasY2 = this.series.some((s) => s.scale === "y2");
    const opts = {
      width: fitWidth(this.box),
      height: this.height,
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
      legend: { live: true },
      scales: { x: { time: false } },
      series: [
        { label: "step", value: (u, v, si, idx) => String((idx == null ? this.steps[this.steps.length - 1] : v) ?? "—") },
        ...this.series.map((s) => ({
          label: s.label,
          stroke: cssVar(s.colorVar),
          width: 1.5,
          scale: s.scale || "y",
          // A sparse series (the held-out loss, every eval_every steps): joined, with dots.
          spanGaps: Boolean(s.sparse),
          points: { show: Boolean(s.sparse) },
          // Not hovering: the legend shows the newest value instead of a blank.
          value: (u, v, si, idx) => {
            const val = idx == null ? this.last(s.key) : v;
            return val == null ? "—" : s.fmt ? s.fmt(val) : String(val);
          },
        })),
      ],
      axes: [
        { ...ax, label: "step", labelSize: 18, labelFont: ax.font },
        { ...ax, scale: "y", label: this.yLabel, labelSize: 18, labelFont: ax.font, size: 56 },
        ...(hasY2 ? [{ ...ax, scale: "y2", side: 1, label: this.y2Label, labelSize: 18, labelFont: ax.font, size: 56, grid: { show: false } }] : []),
      ],
      plugins: [markerLines(this.getMarks)],
    };
    this.plot = new window.uPlot(opts, [this.steps, ...this.cols], this.box);
  }

  /** Merge metric points (each {step, ...}); a re-reported step replaces its old values. */
  append(points) {
    if (!points.length) return;
    let ordered = true;
    for (const p of points) {
      const at = this.index.get(p.step);
      if (at !== undefined) {
        this.series.forEach((s, i) => { this.cols[i][at] = num(p[s.key]); });
        continue;
      }
      if (this.steps.length && p.step < this.steps[this.steps.length - 1]) ordered = false;
      this.index.set(p.step, this.steps.length);
      this.steps.push(p.step);
      this.series.forEach((s, i) => this.cols[i].push(num(p[s.key])));
    }
    if (!ordered) this.sort();
    this.plot.setData([this.steps, ...this.cols]);
  }

  sort() {
    const order = this.steps.map((s, i) => i).sort((a, b) => this.steps[a] - this.steps[b]);
    this.steps = order.map((i) => this.steps[i]);
    this.cols = this.cols.map((c) => order.map((i) => c[i]));
    this.index = new Map(this.steps.map((s, i) => [s, i]));
  }

  reset() {
    this.steps = [];
    this.cols = this.series.map(() => []);
    this.index = new Map();
    this.plot.setData([this.steps, ...this.cols]);
  }

  /** The newest value of series `key` (for the readout beside the chart). */
  last(key) {
    const i = this.series.findIndex((s) => s.key === key);
    const col = this.cols[i] || [];
    for (let j = col.length - 1; j >= 0; j--) if (col[j] != null) return col[j];
    return null;
  }

  redraw() { this.plot.redraw(false, false); }

  destroy() {
    this.observer.disconnect();
    if (this.plot) this.plot.destroy();
    if (debug.charts[this.id] === this) delete debug.charts[this.id];
  }
}

function num(v) {
  return v === null || v === undefined || !Number.isFinite(Number(v)) ? null : Number(v);
}

/**
 * World size over wall-clock time, stepped, with a points-only series per marker type
 * (node lost, failure, straggler, resize, resume, checkpoint, first step) so each has a legend entry
 * and hover value.
 */
export class WorldSizeChart {
  constructor(box, { id = "world" } = {}) {
    this.box = box;
    this.id = id;
    this.types = Object.keys(MARKERS);
    this.data = [[], [], ...this.types.map(() => [])];
    this.plot = null;
    this.maxWs = 1;
    this.observer = new ResizeObserver(() => {
      if (this.plot) this.plot.setSize({ width: fitWidth(this.box), height: 180 });
    });
    this.observer.observe(box);
    this.build();
    debug.charts[id] = this;
  }

  build() {
    if (this.plot) this.plot.destroy();
    const ax = axisStyle();
    const accent = cssVar("--accent");
    const opts = {
      width: fitWidth(this.box),
      height: 180,
      cursor: { points: { size: 6 } },
      scales: { x: { time: true }, y: { range: () => [0, this.maxWs + 1] } },
      series: [
        {},
        {
          label: "world size",
          stroke: accent,
          fill: accent + "22",
          width: 2,
          paths: window.uPlot.paths.stepped({ align: 1 }),
          points: { show: false },
          value: (u, v) => (v == null ? "—" : String(v)),
        },
        ...this.types.map((t) => ({
          label: MARKERS[t].label,
          stroke: cssVar(MARKERS[t].cssVar),
          fill: cssVar(MARKERS[t].cssVar),
          width: 0,
          paths: () => null,
          // A ring (around the resume dot that a first step usually shares its time with).
          points: MARKERS[t].ring
            ? { show: true, size: 14, width: 2, fill: "transparent" }
            : { show: true, size: 9, width: 1, fill: cssVar(MARKERS[t].cssVar) },
          value: (u, v) => (v == null ? "" : "●"),
        })),
      ],
      axes: [
        { ...ax, values: (u, splits) => splits.map(clock) },
        { ...ax, label: "workers", labelSize: 18, labelFont: ax.font, size: 56, incrs: [1, 2, 4, 8, 16, 32, 64] },
      ],
    };
    this.plot = new window.uPlot(opts, this.data, this.box);
  }

  /**
   * events: API events; checkpoints: API checkpoints; job: the job (for "now").
   * Points are (time, world size in effect); markers sit on the line at their time. A
   * timeline's marker sits at its first step (where the start or recovery ended), not at
   * when it was stored, and leaves the line to the transitions.
   */
  update(events, checkpoints, job, toSec) {
    const rows = [];
    for (const ev of events) {
      const type = classifyEvent(ev);
      const first = type === "first_step" ? firstStepAt(ev) : null;
      const t = toSec(first ?? ev.at);
      if (t === null) continue;
      rows.push({ t, ws: first === null ? ev.world_size_after ?? null : null, type });
    }
    for (const c of checkpoints) {
      const t = toSec(c.committed_at);
      if (t !== null) rows.push({ t, ws: null, type: "checkpoint", cws: c.world_size });
    }
    rows.sort((a, b) => a.t - b.t);
    const end = job.finished_at ? toSec(job.finished_at) : Date.now() / 1000;
    const xs = [];
    const ws = [];
    const marks = this.types.map(() => []);
    let cur = 0;
    for (const r of rows) {
      if (r.ws !== null) cur = r.ws;
      const mi = r.type ? this.types.indexOf(r.type) : -1;
      xs.push(r.t);
      ws.push(cur);
      marks.forEach((m, i) => m.push(i === mi ? (r.type === "checkpoint" ? r.cws ?? cur : cur) : null));
    }
    if (end !== null && (!xs.length || end > xs[xs.length - 1])) {
      xs.push(end);
      ws.push(job.world_size ?? cur);
      marks.forEach((m) => m.push(null));
    }
    this.maxWs = Math.max(1, ...ws, ...marks.flat().filter((v) => v != null));
    this.data = [xs, ws, ...marks];
    this.plot.setData(this.data);
  }

  destroy() {
    this.observer.disconnect();
    if (this.plot) this.plot.destroy();
    if (debug.charts[this.id] === this) delete debug.charts[this.id];
  }
}

/** Local wall-clock time of an epoch-seconds tick, "14:05" or "14:05:30". */
function clock(t) {
  const d = new Date(t * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  return d.getSeconds() ? `${hm}:${pad(d.getSeconds())}` : hm;
}

/** The marker colour key shown under the charts. */
export function markerKey(types = Object.keys(MARKERS)) {
  return h("ul", { class: "marker-key", "aria-label": "Marker colours" },
    ...types.map((t) => h("li", { title: MARKERS[t].hint },
      h("span", { class: `swatch swatch-${t}`, "aria-hidden": "true" }), MARKERS[t].label)));
}
