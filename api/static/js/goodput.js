// Goodput (GET /v1/jobs/{id} `goodput`): where a job's wall time went, as one stacked bar
// and a legend. The API's buckets add up to wall_s; `goodput` is training_s / wall_s, the
// share spent on steps the job kept (service/goodput.py).

import { fmtDuration, h } from "./util.js";

// Bar order: the kept training first (its length is the headline), then time lost to
// failures and elasticity, then overhead every job pays. Each bucket's colour is its
// `.gp-<key>` class in app.css; the legend's text carries the same information.
export const BUCKETS = [
  { key: "training", field: "training_s", label: "training", hint: "steps the job kept" },
  { key: "recomputed", field: "recomputed_s", label: "recomputed", hint: "steps lost to a failure and computed again" },
  { key: "recovering", field: "recovering_s", label: "recovering", hint: "relaunching after a failure or a lost node" },
  { key: "resizing", field: "resizing_s", label: "resizing", hint: "stopping to grow or shrink" },
  { key: "checkpoint_stall", field: "checkpoint_stall_s", label: "checkpoint stalls", hint: "training blocked by checkpoint saves" },
  { key: "starting", field: "starting_s", label: "starting", hint: "from admission to the first step" },
  { key: "queued", field: "queued_s", label: "queued", hint: "waiting for admission" },
  { key: "other", field: "other_s", label: "other", hint: "between steps: reporting, data loading, unreported work" },
];

/** "91%" (the headline and the job list): whole percent, "—" before any time has passed. */
export function fmtGoodput(ratio) {
  return ratio === null || ratio === undefined || !Number.isFinite(ratio) ? "—" : `${Math.round(ratio * 100)}%`;
}

/** A bucket's share of the wall time; small ones keep a decimal so they do not read as 0%. */
export function fmtShare(fraction) {
  const p = 100 * fraction;
  if (!(p > 0)) return "0%";
  if (p < 0.1) return "<0.1%";
  return p < 9.95 ? `${p.toFixed(1)}%` : `${Math.round(p)}%`;
}

/** Like fmtDuration, with tenths under 10 s: checkpoint stalls are often fractions of one. */
export function fmtSeconds(s) {
  if (!Number.isFinite(s)) return "—";
  if (s > 0 && s < 0.05) return "<0.1s";
  return s < 9.95 ? `${Number(s.toFixed(1))}s` : fmtDuration(s);
}

/** The non-empty buckets of a goodput object: [{...bucket, seconds, share}]. */
export function splitOf(g) {
  const wall = Number(g.wall_s) || 0;
  return BUCKETS
    .map((b) => ({ ...b, seconds: Math.max(0, Number(g[b.field]) || 0) }))
    .filter((b) => b.seconds > 0 && wall > 0)
    .map((b) => ({ ...b, share: b.seconds / wall }));
}

/** The panel for the job page: {el, update(goodput)}; update is cheap when nothing changed. */
export function goodputPanel() {
  const value = h("span", { class: "num big goodput-value", id: "goodput-value" }, "—");
  const wall = h("span", { class: "readout", id: "goodput-wall" });
  const bar = h("div", { class: "goodput-bar", id: "goodput-bar", role: "img", "aria-label": "Goodput: no data yet" });
  const legend = h("ul", { class: "goodput-legend", id: "goodput-legend", "aria-label": "Where the wall time went" });
  const el = h("section", { class: "panel", id: "goodput-panel", "aria-labelledby": "h-goodput" },
    h("div", { class: "panel-head goodput-head" },
      h("h2", { id: "h-goodput", title: "Share of the job's wall time spent on training steps it kept" }, "Goodput"),
      value, wall),
    h("div", { class: "goodput-body" }, bar, legend));
  let sig = "";

  function update(g) {
    // An API without goodput (older service): no panel rather than an empty one.
    el.hidden = !g;
    if (!g) return;
    const next = JSON.stringify(g);
    if (next === sig) return;
    sig = next;
    const parts = splitOf(g);
    const headline = fmtGoodput(g.goodput);
    value.textContent = headline;
    value.dataset.goodput = g.goodput ?? "";
    wall.textContent = g.wall_s > 0 ? `of ${fmtSeconds(g.wall_s)} wall time` : "";
    // What a screen reader (and a hover) gets: the same numbers as the legend, in words.
    const said = (p) => `${p.label} ${fmtSeconds(p.seconds)} (${fmtShare(p.share)})`;
    const summary = parts.length
      ? `Goodput ${headline} of ${fmtSeconds(g.wall_s)}: ${parts.map(said).join(", ")}`
      : "Goodput: no time recorded yet";
    bar.setAttribute("aria-label", summary);
    bar.title = summary;
    bar.replaceChildren(...parts.map((p) => h("span", {
      class: `gp-seg gp-${p.key}`, "data-bucket": p.key, title: `${said(p)}: ${p.hint}`,
      style: `width:${(100 * p.share).toFixed(3)}%`,
    })));
    legend.replaceChildren(...(parts.length ? parts.map((p) => h("li", { "data-bucket": p.key, "data-seconds": p.seconds, title: p.hint },
      h("span", { class: `swatch gp-${p.key}`, "aria-hidden": "true" }),
      h("span", { class: "gp-label" }, p.label),
      h("span", { class: "num gp-seconds" }, fmtSeconds(p.seconds)),
      h("span", { class: "num muted gp-share" }, fmtShare(p.share))))
      : [h("li", { class: "muted" }, "No time recorded yet.")]));
  }

  return { el, update };
}
