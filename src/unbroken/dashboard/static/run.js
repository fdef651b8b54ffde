// One run's live page: a snapshot arrives over server-sent events at every change of its ledger.
"use strict";
const runName = decodeURIComponent(location.pathname.slice("/run/".length));
const BADPUT_COLORS = {
  checkpoint_save: "#7c3aed", checkpoint_load: "#a78bfa", startup: "#64748b", rendezvous: "#0891b2",
  pg_init: "#06b6d4", model_build: "#14b8a6", data: "#84cc16", shutdown: "#94a3b8", preemption: "#f59e0b",
  reexecuted: "#f97316", detection: "#dc2626", recovery: "#ef4444", other: "#cbd5e1",
};
let stepChart = null;
let ckptChart = null;
let current = null;

function faultTimes(snap) {
  return (snap.faults || []).filter((f) => f.disruptive).map((f) => f.t);
}

function rollbacks(t, step) {
  const out = [];
  for (let i = 1; i < step.length; i++) if (step[i] < step[i - 1]) out.push([t[i], step[i]]);
  return out;
}

function drawMarks(u) {
  if (!current) return;
  const ctx = u.ctx;
  const { left, top, width, height } = u.bbox;
  ctx.save();
  ctx.strokeStyle = "#dc2626";
  ctx.lineWidth = 2 * devicePixelRatio;
  ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
  let marks = 0;
  for (const t of faultTimes(current)) {
    const x = u.valToPos(t, "x", true);
    if (x < left || x > left + width) continue;
    ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
    marks++;
  }
  ctx.setLineDash([]);
  ctx.fillStyle = "#f97316";
  for (const [t, s] of rollbacks(current.series.t, current.series.step)) {
    const x = u.valToPos(t, "x", true), y = u.valToPos(s, "y", true);
    const r = 5 * devicePixelRatio;
    ctx.beginPath(); ctx.moveTo(x, y - r); ctx.lineTo(x - r, y + r); ctx.lineTo(x + r, y + r); ctx.fill();
  }
  ctx.restore();
  u.root.parentElement.dataset.faultMarks = String(marks);
}

function chartWidth(id) {
  return Math.max(300, document.getElementById(id).clientWidth || 800);
}

function renderStepChart(snap) {
  const holder = document.getElementById("step-chart");
  // A rollback breaks the line: a gap (null) between the last step before it and the resume.
  const t = [], step = [];
  snap.series.t.forEach((x, i) => {
    if (i && snap.series.step[i] < snap.series.step[i - 1]) { t.push((x + snap.series.t[i - 1]) / 2); step.push(null); }
    t.push(x); step.push(snap.series.step[i]);
  });
  const data = [t, step];
  if (!stepChart) {
    stepChart = new uPlot({
      width: chartWidth("step-chart"), height: 300,
      scales: { x: { time: false } },
      axes: [{ label: "wall time (s)" }, { label: "step" }],
      series: [{ label: "s" }, { label: "step", stroke: "#2563eb", width: 2, points: { show: false } }],
      hooks: { draw: [drawMarks] },
    }, data, holder);
  } else {
    stepChart.setData(data);
  }
  holder.dataset.points = String(snap.series.t.length);
  holder.dataset.maxStep = String(snap.series.step.length ? Math.max(...snap.series.step) : -1);
}

function renderCkptChart(ck) {
  const ser = ck.persist_series || [];
  const data = [ser.map((p) => p[0]), ser.map((p) => p[1])];
  if (!ckptChart) {
    ckptChart = new uPlot({
      width: chartWidth("ckpt-chart"), height: 180,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label: "persist s" }],
      series: [{ label: "step" }, { label: "persist s", stroke: "#7c3aed", width: 1.5 }],
    }, data, document.getElementById("ckpt-chart"));
  } else {
    ckptChart.setData(data);
  }
}

function card(label, value, cls) {
  return el("div", { class: "card " + (cls || "") }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }));
}

function renderCards(snap) {
  const f = snap.figures, r = snap.restarts;
  const budget = r.launcher_budget ? `${r.launcher_used} / ${r.launcher_budget}` : String(r.launcher_used);
  const spent = r.launcher_budget && r.launcher_used / r.launcher_budget >= 0.8;
  document.getElementById("cards").replaceChildren(
    card("steps completed", fmt.int(f.steps_completed)),
    card("step rate", f.step_rate === null ? "–" : f.step_rate.toFixed(2) + " /s"),
    card("median step", f.step_time_s_median === null ? "–" : fmt.s(f.step_time_s_median, 3) + " s"),
    card("training goodput", fmt.pct(f.training_goodput)),
    card("infra goodput", fmt.pct(f.infra_goodput)),
    card("availability", fmt.pct(f.availability)),
    card("checkpoint efficiency", fmt.pct(f.checkpoint_efficiency)),
    card("faults", fmt.int(f.faults)),
    card("steps lost", fmt.int(f.steps_lost)),
    card("degradation cost", f.degraded_s ? fmt.s(f.degraded_s, 2) + " s" : "–"),
    card("stragglers", fmt.int((snap.stragglers || []).length), (snap.stragglers || []).length ? "warn" : ""),
    card("launcher restarts", budget, spent ? "warn" : ""),
    card("in-process restarts", fmt.int(r.inprocess_iterations)),
  );
}

function renderBadput(snap) {
  const bar = document.getElementById("badput-bar");
  const wall = snap.wall_s || 0;
  const parts = [["productive", snap.figures.productive_s]].concat(
    Object.entries(snap.badput_s).filter(([, s]) => s > 0).sort((a, b) => b[1] - a[1]));
  bar.replaceChildren(...parts.filter(([, s]) => s > 0).map(([name, s]) => {
    const seg = el("div", { class: "segment", title: `${name}: ${s.toFixed(2)} s` });
    seg.style.width = (wall ? (100 * s) / wall : 0) + "%";
    seg.style.background = name === "productive" ? "#16a34a" : BADPUT_COLORS[name] || "#999";
    return seg;
  }));
  const ml = snap.ml_goodput || {};
  const custom = Object.entries(snap.custom_s || {}).map(([n, s]) => `${n} ${fmt.s(s)} s`);
  fillTable(document.getElementById("badput"), ["category", "ml-goodput", "seconds", "% of wall"],
    parts.map(([n, s]) => [
      n === "custom" && custom.length ? `custom (${custom.join(", ")})` : n,
      ml[n] || "–", fmt.s(s), wall ? ((100 * s) / wall).toFixed(1) + "%" : "–",
    ]));
}

function renderFaults(snap) {
  const rows = (snap.faults || []).map((f) => [
    f.index, f.kind || "–", f.fault_class || "–", f.phase || "–", f.rank, fmt.int(f.step), f.cause || "–", f.detector || "–",
    f.layer || "–", fmt.s(f.detection_s, 3), fmt.s(f.recovery_s, 3), fmt.int(f.steps_lost),
    f.restore_tier || "–", fmt.int(f.restored_step),
  ]);
  fillTable(document.getElementById("faults"),
    ["#", "kind", "class", "phase", "rank", "step", "cause", "detector", "layer", "detection s", "recovery s",
      "steps lost", "restore tier", "restored step"], rows);
}

function renderFaultGroups(snap) {
  const headers = ["faults", "recovered", "recovery s p50 / p95 / max", "failed restarts",
    "steps lost (max, per incident)", "detection s p50"];
  document.getElementById("fault-groups").hidden = !(snap.faults || []).length;
  for (const [id, key] of [["by-class", "class"], ["by-phase", "phase"]]) {
    const groups = snap["by_" + key] || {};
    fillTable(document.getElementById(id), [key, ...headers], Object.entries(groups).map(([name, g]) => [
      name, g.faults, `${g.recovered} (${fmt.pct(g.recovery_rate)})`,
      `${fmt.s(g.recovery_s_p50)} / ${fmt.s(g.recovery_s_p95)} / ${fmt.s(g.recovery_s_max)}`,
      g.failed_restarts, `${g.steps_lost} (${fmt.int(g.steps_lost_max)}, ${fmt.s(g.steps_lost_mean, 1)})`,
      fmt.s(g.detection_s_p50, 3),
    ]));
  }
}

function renderCheckpoint(snap) {
  const c = snap.checkpoint;
  const rows = c.enabled ? [
    ["newest commit", c.last_commit_step === null ? "none yet" : "step " + c.last_commit_step],
    ["its age", fmt.age(c.last_commit_age_s)],
    ["steps since", fmt.int(c.steps_since_commit)],
    ["saves skipped (in a row)", `${c.skipped_total} (${c.skipped_in_a_row})`],
    ["saves in flight", fmt.int(c.in_flight)],
    ["staging memory", fmt.bytes(c.staging_bytes)],
    ["writer RSS", fmt.bytes(c.writer_rss_bytes)],
    ["blocking per save (median)", fmt.s(c.blocking_s_median, 3) + " s"],
    ["persist (last / median)", `${fmt.s(c.persist_s_last, 3)} / ${fmt.s(c.persist_s_median, 3)} s`],
    ["unprotected (saves failed)", `${fmt.s(c.unprotected_s, 1)} s (${fmt.int(c.failed_saves)})`],
  ] : [["checkpoints", "none in this run"]];
  if (c.enabled && c.failed_saves) rows.push(["last save error", c.last_error || "–"]);
  const t = document.getElementById("checkpoint");
  t.replaceChildren(...rows.map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { text: v }))));
  renderCkptChart(c);
}

// A warning line while the newest failed save is newer than the newest commit.
function renderStorage(snap) {
  const c = snap.checkpoint, line = document.getElementById("storage-failing");
  line.hidden = !c.storage_failing;
  if (!c.storage_failing) { line.textContent = ""; return; }
  const lasting = c.storage_failing_since === null ? "" : " for " + fmt.age(Math.max(0, snap.now - c.storage_failing_since));
  const when = snap.status === "running" ? "Checkpoint storage failing" + lasting : "Checkpoint storage was failing at the end of the run";
  const newest = c.last_commit_step === null ? "none committed yet" : "newest: step " + c.last_commit_step;
  line.textContent = `${when}: ${c.failed_saves} save(s) failed` + (c.last_error ? ` (last error: ${c.last_error.split("\n")[0]})` : "") +
    `. Training goes on from the memory tier, but a lost node loses every step since the newest commit (${newest}).`;
}

function renderRanks(snap) {
  const running = snap.status === "running";
  fillTable(document.getElementById("ranks"),
    ["rank", "last step", "heartbeat age", "step time (median of last 20)", "vs median",
      "busy (last 20 steps)", "straggler", "attempt", "iteration"],
    snap.ranks.map((r) => [r.rank, fmt.int(r.last_step), running ? fmt.age(r.heartbeat_age_s) : "ended",
      fmt.s(r.step_time_s, 4) + " s", r.deviation === null ? "–" : (r.deviation >= 0 ? "+" : "") + (100 * r.deviation).toFixed(1) + "%",
      fmt.pct(r.busy_ratio), r.straggler ? "yes" : "", r.attempt, r.iteration]),
    (i) => (snap.ranks[i].straggler ? "straggler" : ""));
  const eps = snap.stragglers || [];
  fillTable(document.getElementById("stragglers"),
    ["rank", "from (s into the run)", "for s", "steps", "busy", "others' busy"],
    eps.length ? eps.map((x) => [x.rank, fmt.s(x.t, 1), fmt.s(x.duration_s, 1), fmt.int(x.steps),
      fmt.pct(x.busy_ratio), fmt.pct(x.others_ratio)]) : [["none", "", "", "", "", ""]]);
}

function renderAlerts(snap) {
  const ul = document.getElementById("alerts");
  const alerts = (snap.alerts || []).slice().reverse();
  if (!alerts.length) { ul.replaceChildren(el("li", { class: "muted", text: "none" })); return; }
  ul.replaceChildren(...alerts.map((a) => el("li", { class: "alert " + a.severity, "data-name": a.name },
    el("span", { class: "sev", text: a.severity }), el("b", { text: a.name }), " ",
    el("span", { text: a.summary }), el("span", { class: "muted", text: " " + new Date(a.ts * 1000).toLocaleTimeString() }))));
}

function render(snap) {
  current = snap;
  document.getElementById("run-name").textContent = snap.name;
  const badge = document.getElementById("status");
  badge.textContent = snap.status;
  badge.className = "badge " + snap.status;
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  const note = document.getElementById("note");
  note.hidden = !snap.note;
  note.textContent = snap.note || "";
  if (!snap.figures) return; // waiting for records, or an error
  renderAlerts(snap);
  renderCards(snap);
  renderStepChart(snap);
  renderBadput(snap);
  renderFaults(snap);
  renderFaultGroups(snap);
  renderCheckpoint(snap);
  renderStorage(snap);
  renderRanks(snap);
  const l = snap.ledger;
  document.getElementById("ledger").textContent = `${l.records} ledger records in ${l.files} files` +
    (l.torn_lines ? `; ${l.torn_lines} cut last line(s) skipped` : "") +
    (l.bad_lines ? `; ${l.bad_lines} unparsable line(s) skipped (${l.bad_line_positions.join(", ")})` : "");
}

function connect() {
  const src = new EventSource("/api/run/" + encodeURIComponent(runName).replace(/%2F/g, "/") + "/stream");
  src.addEventListener("snapshot", (ev) => render(JSON.parse(ev.data)));
  src.onerror = () => {
    const badge = document.getElementById("status");
    badge.textContent = "reconnecting";
    badge.className = "badge waiting";
  };
}

window.addEventListener("resize", () => {
  if (stepChart) stepChart.setSize({ width: chartWidth("step-chart"), height: 300 });
  if (ckptChart) ckptChart.setSize({ width: chartWidth("ckpt-chart"), height: 180 });
});
connect();
