// The app shell: a hash router (#/, #/jobs/ID, #/submit, #/cluster), the top bar's
// connection indicator, theme toggle and token button. Each view is a module exporting
// `mount(main, params) -> unmount()`; unmount stops its polling.

import { connection, getToken, onTokenChange, setToken } from "./api.js";
import * as list from "./list.js";
import * as job from "./job.js";
import * as submit from "./submit.js";
import * as cluster from "./cluster.js";
import { debug, fmtDuration } from "./util.js";

const routes = [
  { re: /^\/?$/, view: list, nav: "list", title: "Jobs" },
  { re: /^\/jobs\/(\d+)$/, view: job, nav: "list", title: "Job" },
  { re: /^\/submit$/, view: submit, nav: "submit", title: "Submit" },
  { re: /^\/cluster$/, view: cluster, nav: "cluster", title: "Cluster" },
];

const main = document.getElementById("main");
let unmount = null;

function route() {
  const raw = location.hash.replace(/^#/, "");
  const [path, query = ""] = raw.split("?");
  const found = routes.find((r) => r.re.test(path || "/"));
  if (unmount) { unmount(); unmount = null; }
  main.replaceChildren();
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (found && a.dataset.nav === found.nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (!found) {
    main.append(Object.assign(document.createElement("h1"), { textContent: "Not found" }));
    document.title = "Not found · elastrain";
    return;
  }
  document.title = `${found.title} · elastrain`;
  const params = { match: path.match(found.re), query: new URLSearchParams(query) };
  unmount = found.view.mount(main, params) || null;
  debug.route = path || "/";
}

function initTopbar() {
  const conn = document.getElementById("conn");
  const text = conn.querySelector(".conn-text");
  const show = () => {
    const s = connection.state;
    conn.dataset.state = s;
    text.textContent = s === "ok" ? "live" : s === "auth" ? "token needed"
      : s === "error" ? `API unreachable ${fmtDuration((Date.now() - connection.since) / 1000)}` : "connecting…";
  };
  connection.onChange = show;
  setInterval(() => { if (connection.state === "error") show(); }, 1000);
  show();

  const signout = document.getElementById("signout");
  const syncToken = () => { signout.hidden = !getToken(); };
  onTokenChange(syncToken);
  syncToken();
  signout.addEventListener("click", () => { setToken(null); location.reload(); });

  document.getElementById("theme").addEventListener("click", () => {
    const root = document.documentElement;
    const dark = root.dataset.theme
      ? root.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    root.dataset.theme = dark ? "light" : "dark";
    try { localStorage.setItem("elastrain.theme", root.dataset.theme); } catch { /* ignore */ }
    window.dispatchEvent(new Event("themechange"));
  });
}

initTopbar();
window.addEventListener("hashchange", route);
route();
