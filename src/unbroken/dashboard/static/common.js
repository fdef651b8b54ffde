// Formatting and table helpers shared by the pages. No framework, no network beyond this server.
"use strict";
const fmt = {
  pct: (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(1) + "%"),
  s: (x, d = 2) => (x === null || x === undefined ? "–" : Number(x).toFixed(d)),
  int: (x) => (x === null || x === undefined ? "–" : String(x)),
  bytes: (x) => {
    if (x === null || x === undefined) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
    return x.toFixed(i ? 1 : 0) + " " + u[i];
  },
  age: (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  },
};

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function fillTable(table, headers, rows, rowClass) {
  table.replaceChildren();
  const head = el("tr");
  for (const h of headers) head.append(el("th", { text: h }));
  table.append(head);
  rows.forEach((r, i) => {
    const tr = el("tr");
    if (rowClass) tr.className = rowClass(i) || "";
    for (const c of r) tr.append(c instanceof Node ? el("td", {}, c) : el("td", { text: String(c) }));
    table.append(tr);
  });
}
