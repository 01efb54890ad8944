// Cluster (#/cluster): the scheduler's latest snapshot of the Ray cluster: nodes alive and
// lost, CPUs/GPUs used and free, which jobs run where, and a link to Ray's own dashboard.

import { api } from "./api.js";
import { fmtAge, h, poll } from "./util.js";

const POLL_MS = 2000;

export function mount(main) {
  const head = h("div", { class: "page-head" }, h("h1", {}, "Cluster"));
  const summary = h("dl", { class: "stats", id: "cluster-summary" });
  const note = h("p", { class: "muted", id: "cluster-note", "aria-live": "polite" });
  const nodes = h("div", { class: "nodes", id: "cluster-nodes" });
  const error = h("p", { class: "error-text", role: "alert", hidden: true });
  const rayLink = h("a", { class: "btn", id: "ray-dashboard", target: "_blank", rel: "noopener", hidden: true }, "Ray dashboard ↗");
  head.append(rayLink);
  main.append(head, error, summary, note, nodes);

  let lastSig = "";
  async function refresh() {
    let c;
    try {
      c = await api.cluster();
    } catch (e) {
      error.hidden = false;
      error.textContent = e.message;
      return;
    }
    error.hidden = true;
    if (c.dashboard_url) {
      rayLink.hidden = false;
      rayLink.href = /^https?:\/\//.test(c.dashboard_url) ? c.dashboard_url : `http://${c.dashboard_url}`;
    } else rayLink.hidden = true;
    note.textContent = !c.connected
      ? "The scheduler is not connected to a Ray cluster (it may not be running, or it is starting)."
      : c.updated_at ? `Snapshot from the scheduler, ${fmtAge(c.updated_at)} ago.` : "";
    const sig = JSON.stringify([c.connected, c.nodes]);
    if (sig === lastSig) return;
    lastSig = sig;
    render(c);
  }

  function render(c) {
    const list = c.nodes || [];
    const alive = list.filter((n) => n.alive);
    const sum = (key) => alive.reduce((a, n) => a + (Number(n[key]) || 0), 0);
    const cpusT = sum("cpus_total"), cpusF = sum("cpus_free");
    const gpusT = sum("gpus_total"), gpusF = sum("gpus_free");
    const jobs = new Set(list.flatMap((n) => n.jobs || []));
    const draining = alive.filter((n) => n.drain).length;
    const warming = alive.filter((n) => !n.drain && n.warming).length;
    const stat = (label, value, sub) => h("div", { class: "stat" }, h("dt", {}, label),
      h("dd", {}, h("span", { class: "num big" }, value), sub ? h("span", { class: "muted" }, ` ${sub}`) : ""));
    summary.replaceChildren(
      stat("Nodes alive", `${alive.length}`, [
        list.length > alive.length ? `· ${list.length - alive.length} lost` : "",
        draining ? `· ${draining} draining` : "",
        warming ? `· ${warming} warming` : "",
      ].filter(Boolean).join(" ")),
      stat("CPUs used", `${fmt(cpusT - cpusF)} / ${fmt(cpusT)}`, `· ${fmt(cpusF)} free`),
      stat("GPUs used", `${fmt(gpusT - gpusF)} / ${fmt(gpusT)}`, `· ${fmt(gpusF)} free`),
      stat("Jobs placed", `${jobs.size}`),
    );
    if (!list.length) {
      nodes.replaceChildren(h("p", { class: "muted empty-state" }, c.connected ? "No nodes reported." : "No cluster data yet."));
      return;
    }
    // Alive first, then by address, so lost nodes sink but stay visible.
    const sorted = [...list].sort((a, b) => (b.alive - a.alive) || String(a.address).localeCompare(String(b.address)));
    nodes.replaceChildren(...sorted.map((n) => h("article", {
      class: `node ${n.alive ? "alive" : "lost"}`, "data-node-id": n.node_id, "aria-label": `Node ${n.address}`,
    },
    h("header", {},
      // Warming: just joined, its worker processes still starting; jobs grow onto it after.
      h("span", { class: `badge ${!n.alive ? "badge-failed" : n.drain ? "badge-draining" : n.warming ? "badge-warming" : "badge-alive"}`,
        title: n.alive && !n.drain && n.warming ? "Joined; worker processes still starting" : "" },
        !n.alive ? "LOST" : n.drain ? "DRAINING" : n.warming ? "WARMING" : "ALIVE"),
      h("strong", { class: "mono" }, n.address || "?"),
      h("span", { class: "muted mono small", title: n.node_id }, String(n.node_id).slice(0, 12))),
    // A draining node is going away: what drained it, why, and until when.
    ...(n.alive && n.drain ? [drainNote(n.drain)] : []),
    // A lost node's last numbers mean nothing now: say so rather than show them.
    ...(n.alive
      ? [meter("CPU", n.cpus_total - n.cpus_free, n.cpus_total), meter("GPU", n.gpus_total - n.gpus_free, n.gpus_total)]
      : [h("p", { class: "muted small" }, `${fmt(n.cpus_total)} CPUs, ${fmt(n.gpus_total)} GPUs unavailable`)]),
    h("div", { class: "node-jobs" }, h("span", { class: "muted small" }, "Jobs: "),
      ...(n.jobs && n.jobs.length
        ? n.jobs.map((id) => h("a", { class: "chip", href: `#/jobs/${id}` }, `#${id}`))
        : [h("span", { class: "muted small" }, "none")])))));
  }

  const poller = poll(refresh, POLL_MS);
  return () => poller.stop();
}

function fmt(x) {
  const n = Number(x) || 0;
  return Number.isInteger(n) ? String(n) : n.toFixed(1);
}

function meter(label, used, total) {
  const t = Number(total) || 0;
  const u = Math.max(0, Number(used) || 0);
  const pct = t ? Math.min(100, (100 * u) / t) : 0;
  return h("div", { class: "meter-row" },
    h("span", { class: "meter-label" }, label),
    h("div", { class: "meter", role: "meter", "aria-label": `${label} used`, "aria-valuemin": 0, "aria-valuemax": t, "aria-valuenow": u },
      h("div", { class: "meter-fill", style: `width:${pct.toFixed(1)}%` })),
    h("span", { class: "num small" }, t ? `${fmt(u)} / ${fmt(t)} used` : "none"));
}

// "Draining (drained by an operator): kernel upgrade · goes at 14:05:10": jobs leave it at a step boundary.
function drainNote(d) {
  const source = { admin: "drained by an operator", ray: "drained by Ray", preemption: "preemption notice" }[d.source] || d.source;
  // An absolute time: the view is redrawn only when the snapshot changes.
  const when = d.deadline ? `goes at ${new Date(d.deadline * 1000).toLocaleTimeString()}` : "no deadline";
  return h("p", { class: "small drain-note", title: "No new worker lands here; jobs leave at a step boundary." },
    `Draining (${source})${d.reason ? `: ${d.reason}` : ""} · ${when}`);
}
