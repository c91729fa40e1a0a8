// The dashboard: one EventSource on /events pushes a snapshot of the board whenever it changes; nothing polls.
// Every string from the event log goes into the page as text (textContent), never as markup.
"use strict";

const params = new URLSearchParams(location.search);
const jobId = params.get("job");
const charts = {};

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function seconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function fixed(v, digits) { return v === null || v === undefined ? "—" : Number(v).toFixed(digits); }

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fill(table, rows, render) {
  const body = table.tBodies[0];
  body.replaceChildren(...rows.map((row) => { const tr = document.createElement("tr"); render(tr, row); return tr; }));
}

function cells(tr, values) {
  for (const v of values) tr.append(v instanceof Node ? v : el("td", v));
}

function jobs(list) {
  fill(document.getElementById("jobs"), list, (tr, j) => {
    const link = el("a", j.id);
    link.href = `/?job=${encodeURIComponent(j.id)}`;
    const id = el("td"); id.append(link);
    tr.dataset.job = j.id;
    cells(tr, [id, el("td", j.phase, `phase-${j.phase}`), `${j.step}/${j.steps}`, seconds(j.eta_s), j.world,
      `${j.restarts}/${j.max_restarts}`, j.goodput === null ? "—" : `${(100 * j.goodput).toFixed(1)} %`,
      fixed(j.loss, 4), j.reason]);
  });
}

function fleet(list) {
  fill(document.getElementById("fleet"), list, (tr, n) => {
    const state = !n.up ? "lost" : n.cordoned ? "cordoned" : n.spare ? "spare" : "up";
    tr.dataset.node = n.node;
    cells(tr, [n.node, n.kind, n.slots, n.free === null ? "—" : n.free, n.standbys === null ? "—" : n.standbys, state,
      n.seen_s_ago === null ? "—" : `${seconds(n.seen_s_ago)} ago`]);
  });
}

function chart(id, label, xs, ys) {
  const box = document.getElementById(id);
  const data = [xs, ys];
  if (!charts[id]) {
    charts[id] = new uPlot({
      width: 520, height: 220, scales: { x: { time: false } },
      series: [{ label: "step" }, { label, stroke: "#2458a6", width: 1.5, spanGaps: true }],
    }, data, box);
  } else {
    charts[id].setData(data);
  }
  box.dataset.points = String(xs.length);
}

const metricBoxes = new Map();  // a custom metric's name -> the id of its chart's box

function metricCharts(curve) {
  const holder = document.getElementById("metric-charts");
  for (const [name, values] of Object.entries(curve.metrics || {})) {
    if (!metricBoxes.has(name)) {
      const id = `metric-${metricBoxes.size}`;
      const fig = el("figure");
      fig.dataset.metric = name;
      fig.append(el("figcaption", `${name} (rank 0)`));
      const box = el("div");
      box.id = id;
      box.dataset.points = "0";
      fig.append(box);
      holder.append(fig);
      metricBoxes.set(name, id);
    }
    chart(metricBoxes.get(name), name, curve.step, values);
  }
}

function detail(j) {
  const section = document.getElementById("job-section");
  section.hidden = false;
  document.getElementById("job-title").textContent = `${j.id} — ${j.phase}`;
  document.getElementById("job-summary").textContent =
    `step ${j.step} of ${j.steps}, ETA ${seconds(j.eta_s)}, ${j.world} ranks, ` +
    `${j.restarts} of ${j.max_restarts} restarts` + (j.reason ? `: ${j.reason}` : "");
  chart("loss", "loss", j.curve.step, j.curve.loss);
  chart("steptime", "step time (s)", j.curve.step, j.curve.step_time);
  metricCharts(j.curve);
  fill(document.getElementById("incidents"), j.incidents, (tr, i) => {
    tr.dataset.kind = i.kind;
    cells(tr, [i.number, i.kind, i.trigger, i.attempt, seconds(i.fault_s), seconds(i.detect_s), i.decision,
      seconds(i.recover_s), i.steps_redone, i.resolution, i.diagnosis || "—"]);
  });
  fill(document.getElementById("checkpoints"), j.checkpoints, (tr, c) => {
    tr.dataset.state = c.state;
    cells(tr, [c.id, c.step, bytes(c.bytes), c.why ? `${c.state}: ${c.why}` : c.state]);
  });
  fill(document.getElementById("decisions"), j.decisions.slice().reverse(), (tr, d) => {
    cells(tr, [d.at_s === null ? "—" : `+${d.at_s.toFixed(2)} s`, d.type, d.by, d.text]);
  });
  document.getElementById("logs").textContent =
    j.logs.map((l) => `[a${l.attempt} r${l.rank}] ${l.text}`).join("\n");
}

function show(board) {
  document.getElementById("outage").hidden = board.broker_up;
  jobs(board.jobs);
  fleet(board.fleet);
  if (board.job) detail(board.job);
  else if (jobId) {
    document.getElementById("job-section").hidden = false;
    document.getElementById("job-title").textContent = `${jobId}: no such job yet`;
  }
}

const source = new EventSource(`/events${jobId ? `?job=${encodeURIComponent(jobId)}` : ""}`);
const connection = document.getElementById("connection");
source.addEventListener("board", (message) => {
  connection.textContent = `live, updated ${new Date().toLocaleTimeString()}`;
  show(JSON.parse(message.data));
});
source.onerror = () => { connection.textContent = "reconnecting to the server…"; };
