// The index of a folder of runs, refreshed every 2 s, and a search over the knowledge base.
"use strict";
function link(name) {
  return el("a", { href: "/run/" + encodeURIComponent(name).replace(/%2F/g, "/"), text: name });
}

async function loadRuns() {
  const r = await fetch("/api/runs");
  const data = await r.json();
  document.getElementById("root").textContent = data.root;
  const empty = document.getElementById("empty");
  empty.hidden = data.runs.length > 0;
  empty.textContent = `No runs under ${data.root} yet (a run directory holds an events/ folder); this page updates by itself.`;
  fillTable(document.getElementById("runs"),
    ["run", "status", "steps", "training goodput", "infra goodput", "faults", "alerts", "wall time"],
    data.runs.map((x) => [link(x.name), x.status, fmt.int(x.steps_completed), fmt.pct(x.training_goodput),
      fmt.pct(x.infra_goodput), fmt.int(x.faults), x.pages ? `${x.alerts} (${x.pages} page)` : String(x.alerts),
      x.wall_s === null || x.wall_s === undefined ? "–" : fmt.age(x.wall_s)]),
    (i) => (data.runs[i].pages ? "paged" : ""));
}

async function search(q) {
  const note = document.getElementById("search-note");
  const table = document.getElementById("hits");
  if (!q.trim()) { table.hidden = true; note.textContent = ""; return; }
  const r = await fetch("/api/search?q=" + encodeURIComponent(q));
  const data = await r.json();
  if (!r.ok) { note.textContent = data.error; table.hidden = true; return; }
  note.textContent = data.note || `${data.hits.length} run(s) match`;
  table.hidden = !data.hits.length;
  fillTable(table, ["run", "status", "training goodput", "faults", "matched", "path"],
    data.hits.map((h) => [h.served_as ? link(h.served_as) : h.name, h.status, fmt.pct(h.training_goodput),
      h.faults, h.snippet.replace(/\s+/g, " "), h.path]));
}

document.getElementById("search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  search(document.getElementById("search").value).catch((e) => {
    document.getElementById("search-note").textContent = "search failed: " + e;
  });
});
loadRuns();
setInterval(() => loadRuns().catch(() => {}), 2000);
