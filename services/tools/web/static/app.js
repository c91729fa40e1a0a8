// The dashboard: one EventSource on /events pushes a snapshot of the board whenever it changes; nothing polls.
// Every string from the event log goes into the page as text (textContent), never as markup. Actions are the
// platform client's calls, made by the server for whoever presents the operator token (kept for this tab only).
"use strict";

const params = new URLSearchParams(location.search);
const jobId = params.get("job");
const compare = (params.get("compare") || "").split(",").filter(Boolean);
const charts = {};
let board = null;

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
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}


function fixed(v, digits) { return v === null || v === undefined ? "—" : Number(v).toFixed(digits); }

function when(t) { return t ? new Date(t * 1000).toLocaleString() : "—"; }

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

// -- the job list: filtered, sorted and ticked for comparison on the page ------------------------------------------

const ticked = new Set(compare.length ? [jobId, ...compare].filter(Boolean) : []);

function shownJobs(list) {
  const phase = document.getElementById("phase-filter").value;
  const name = document.getElementById("name-filter").value.trim();
  const sort = document.getElementById("sort").value;
  const kept = list.filter((j) => (!phase || j.phase === phase || (phase === "ended" && j.ended)
    || (phase === "live" && !j.ended)) && (!name || j.id.includes(name) || j.name.includes(name)));
  const order = board ? board.phases : [];
  const keys = {
    submitted: (a, b) => (b.submitted_at || 0) - (a.submitted_at || 0),
    age: (a, b) => (a.submitted_at || 0) - (b.submitted_at || 0),
    name: (a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id),
    phase: (a, b) => order.indexOf(a.phase) - order.indexOf(b.phase),
  };
  return kept.sort(keys[sort]);
}

function jobs(list) {
  fill(document.getElementById("jobs"), shownJobs(list), (tr, j) => {
    const link = el("a", j.id);
    link.href = `/?job=${encodeURIComponent(j.id)}`;
    const id = el("td"); id.append(link);
    const box = el("input"); box.type = "checkbox"; box.checked = ticked.has(j.id); box.title = "compare";
    box.addEventListener("change", () => { if (box.checked) ticked.add(j.id); else ticked.delete(j.id); compareLink(); });
    const tick = el("td"); tick.append(box);
    tr.dataset.job = j.id;
    cells(tr, [tick, id, el("td", j.phase, `phase-${j.phase}`), `${j.step}/${j.steps}`, seconds(j.eta_s), j.world,
      `${j.restarts}/${j.max_restarts}`, j.goodput === null ? "—" : `${(100 * j.goodput).toFixed(1)} %`,
      fixed(j.loss, 4), when(j.submitted_at), seconds(j.age_s), j.reason]);
  });
  compareLink();
}

function compareLink() {
  const link = document.getElementById("compare-link");
  const chosen = [...ticked];
  link.hidden = chosen.length < 2;
  link.href = `/?job=${encodeURIComponent(chosen[0] || "")}&compare=${chosen.slice(1).map(encodeURIComponent).join(",")}`;
}

function fleet(list) {
  fill(document.getElementById("fleet"), list, (tr, n) => {
    const state = !n.up ? "lost" : n.cordoned ? "cordoned" : n.spare ? "spare" : "up";
    tr.dataset.node = n.node;
    cells(tr, [n.node, n.kind, n.slots, n.used, n.free === null ? "—" : n.free, n.standbys === null ? "—" : n.standbys,
      n.snapshot_bytes === null ? "—" : bytes(n.snapshot_bytes),
      n.jobs.map((j) => `${j.job} (ranks ${j.ranks.join(", ")})`).join("; ") || "—", state,
      n.seen_s_ago === null ? "—" : `${seconds(n.seen_s_ago)} ago`]);
  });
}

// -- charts --------------------------------------------------------------------------------------------------------

const PALETTE = ["#2458a6", "#b3261e", "#146c2e", "#9a6700"];

// A loss is drawn on a log axis when every value is positive: a x10 spike would flatten a linear one's curve.
function positive(columns) { return columns.every((c) => c.every((v) => v === null || v > 0)); }

function chart(id, labels, xs, columns, log) {
  const box = document.getElementById(id);
  const data = [xs, ...columns];
  const distr = log && positive(columns) ? 3 : 1;
  if (charts[id] && (charts[id].series.length !== data.length || charts[id].distr !== distr)) {
    charts[id].destroy(); delete charts[id];
  }
  if (!charts[id]) {
    charts[id] = new uPlot({
      width: 520, height: 220, scales: { x: { time: false }, y: { distr } },
      series: [{ label: "step" }, ...labels.map((label, i) => ({ label, stroke: PALETTE[i % PALETTE.length],
        width: 1.5, spanGaps: true }))],
    }, data, box);
    charts[id].distr = distr;
    box.dataset.scale = distr === 3 ? "log" : "linear";
  } else {
    charts[id].setData(data);
  }
  box.dataset.points = String(xs.length);
}

const metricBoxes = new Map();  // a custom metric's name -> the id of its chart's box

function box(holder, id, caption, attrs) {
  const fig = el("figure");
  Object.assign(fig.dataset, attrs);
  fig.append(el("figcaption", caption));
  const inner = el("div");
  inner.id = id;
  inner.dataset.points = "0";
  fig.append(inner);
  holder.append(fig);
}

function metricCharts(curve) {
  const holder = document.getElementById("metric-charts");
  for (const [name, values] of Object.entries(curve.metrics || {})) {
    if (!metricBoxes.has(name)) {
      const id = `metric-${metricBoxes.size}`;
      box(holder, id, `${name} (rank 0)`, { metric: name });
      metricBoxes.set(name, id);
    }
    chart(metricBoxes.get(name), [name], curve.step, [values]);
  }
}

function compareCharts(j, compared) {
  const runs = [[j.id, j.curve], ...Object.entries(compared).map(([id, c]) => [id, c.curve])];
  document.getElementById("compare-section").hidden = runs.length < 2;
  if (runs.length < 2) return;
  const steps = [...new Set(runs.flatMap(([, c]) => c.step))].sort((a, b) => a - b);
  const aligned = (c, values) => { const at = new Map(c.step.map((s, i) => [s, values[i]])); return steps.map((s) => at.has(s) ? at.get(s) : null); };
  const names = new Set(runs.flatMap(([, c]) => Object.keys(c.metrics || {})));
  const holder = document.getElementById("compare-charts");
  for (const name of ["loss", ...names]) {
    const id = name === "loss" ? "compare-loss" : `compare-${[...names].indexOf(name)}`;
    if (!document.getElementById(id)) box(holder, id, `${name}: ${runs.map(([r]) => r).join(" vs ")}`, { compare: name });
    chart(id, runs.map(([r]) => r), steps,
      runs.map(([, c]) => aligned(c, name === "loss" ? c.loss : (c.metrics || {})[name] || c.step.map(() => null))),
      name === "loss");
  }
}

// -- one job's page ------------------------------------------------------------------------------------------------

function options(select, values) {
  const chosen = select.value;
  select.replaceChildren(el("option", "all"), ...values.map((v) => el("option", v)));
  select.options[0].value = "";
  select.value = values.map(String).includes(chosen) ? chosen : "";
}

function logs(lines) {
  options(document.getElementById("log-rank"), [...new Set(lines.map((l) => l.rank))].sort((a, b) => a - b));
  options(document.getElementById("log-attempt"), [...new Set(lines.map((l) => l.attempt))].sort((a, b) => a - b));
  const rank = document.getElementById("log-rank").value;
  const attempt = document.getElementById("log-attempt").value;
  const search = document.getElementById("log-search").value;
  const shown = lines.filter((l) => (rank === "" || String(l.rank) === rank)
    && (attempt === "" || String(l.attempt) === attempt) && (!search || l.text.includes(search)));
  const pre = document.getElementById("logs");
  pre.textContent = shown.map((l) => `[a${l.attempt} r${l.rank}] ${l.text}`).join("\n");
  pre.dataset.lines = String(shown.length);
}

function detail(j, compared) {
  const section = document.getElementById("job-section");
  section.hidden = false;
  section.dataset.phase = j.phase;
  document.getElementById("job-title").textContent = `${j.id} — ${j.phase}`;
  document.getElementById("job-summary").textContent =
    `step ${j.step} of ${j.steps}, ETA ${seconds(j.eta_s)}, ${j.world} ranks, ` +
    `${j.restarts} of ${j.max_restarts} restarts` + (j.reason ? `: ${j.reason}` : "") + (j.paused ? ` (paused: ${j.paused})` : "") +
    (j.store_failing ? `; the store REFUSES its checkpoints: ${j.store_failing}` : "") +
    (j.final_unsaved ? `; final state NOT SAVED: ${j.final_unsaved}` : "");
  chart("loss", ["loss"], j.curve.step, [j.curve.loss], true);
  chart("steptime", ["step time (s)"], j.curve.step, [j.curve.step_time]);
  metricCharts(j.curve);
  compareCharts(j, compared);
  fill(document.getElementById("incidents"), j.incidents, (tr, i) => {
    tr.dataset.kind = i.kind;
    const what = el("td", i.trigger);
    const evidence = el("details");
    evidence.append(el("summary", `evidence (${i.evidence.length} events)`));
    const list = el("ol", null, "evidence");
    for (const e of i.evidence) list.append(el("li", `+${e.at_s.toFixed(2)} s  ${e.type}: ${e.what}`));
    evidence.append(list);
    what.append(evidence);
    cells(tr, [i.number, i.kind, what, i.attempt, seconds(i.fault_s), seconds(i.detect_s), i.decision,
      seconds(i.recover_s), i.steps_redone, i.resolution, i.diagnosis || "—"]);
  });
  fill(document.getElementById("spec"), j.spec, (tr, [key, value]) => { tr.dataset.key = key; cells(tr, [key, value]); });
  const p = j.plan;
  document.getElementById("plan").textContent = p ? `planned: ${p.described}` : "no plan recorded: plain data parallelism";
  fill(document.getElementById("layout"), j.layout, (tr, r) => {
    tr.dataset.rank = r.rank; cells(tr, [r.rank, r.node, r.slot, r.pp ?? "", r.dp ?? "", r.tp ?? ""]);
  });
  fill(document.getElementById("checkpoints"), j.checkpoints, (tr, c) => {
    tr.dataset.state = c.state;
    cells(tr, [c.id, c.step, bytes(c.bytes), c.why ? `${c.state}: ${c.why}` : c.state]);
  });
  fill(document.getElementById("decisions"), j.decisions.slice().reverse(), (tr, d) => {
    cells(tr, [d.at_s === null ? "—" : `+${d.at_s.toFixed(2)} s`, d.type, d.by, d.text]);
  });
  logs(j.logs);
}

// -- actions: the operator token, the buttons, what the server answered --------------------------------------------

function token() { return sessionStorage.getItem("flightdeck-token") || ""; }

function actionsState() {
  const live = board && board.job && !board.job.ended;
  const can = Boolean(board && board.actions && token());
  document.getElementById("mode").textContent = !board || !board.actions ? "read-only: this server takes no actions"
    : token() ? "operator" : "read-only: enter the operator token to act";
  for (const b of document.querySelectorAll("#actions button")) {
    b.disabled = !can || !live;
    b.title = !board || !board.actions ? "the server was started without an operator token" : !token()
      ? "enter the operator token first" : !live ? "the job has ended" : "";
  }
}

async function act(action, body) {
  const result = document.getElementById("action-result");
  result.textContent = `${action}…`;
  result.className = "status";
  try {
    const answer = await fetch(`/api/jobs/${encodeURIComponent(jobId)}/${action}`, {
      method: "POST", headers: { "Authorization": `Bearer ${token()}`, "Content-Type": "application/json" },
      body: JSON.stringify(body || {}),
    });
    const said = await answer.json();
    result.textContent = answer.ok ? `${action}: ${said.said}` : `${action} refused: ${said.error}`;
    result.className = answer.ok ? "done" : "refused";
    result.dataset.status = String(answer.status);
  } catch (err) {
    result.textContent = `${action} failed: ${err}`;
    result.className = "refused";
  }
}

for (const b of document.querySelectorAll("#actions > button")) {
  b.addEventListener("click", () => act(b.dataset.action, { reason: `${b.dataset.action} from the dashboard` }));
}
document.getElementById("rollback-form").addEventListener("submit", (e) => {
  e.preventDefault();
  act("rollback", { to_step: document.getElementById("rb-step").value, skip_from: document.getElementById("rb-from").value,
    skip_to: document.getElementById("rb-to").value, reason: "rollback from the dashboard" });
});
document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("flightdeck-token", document.getElementById("token").value.trim());
  document.getElementById("token").value = "";
  actionsState();
});
for (const id of ["phase-filter", "name-filter", "sort"]) {
  document.getElementById(id).addEventListener("input", () => board && jobs(board.jobs));
}
for (const id of ["log-rank", "log-attempt", "log-search"]) {
  document.getElementById(id).addEventListener("input", () => board && board.job && logs(board.job.logs));
}

function show(next) {
  board = next;
  const phases = document.getElementById("phase-filter");
  if (phases.options.length === 3) for (const p of board.phases) phases.append(el("option", p));
  document.getElementById("outage").hidden = board.broker_up;
  jobs(board.jobs);
  fleet(board.fleet);
  if (board.job) detail(board.job, board.compare || {});
  else if (jobId) {
    document.getElementById("job-section").hidden = false;
    document.getElementById("job-title").textContent = `${jobId}: no such job yet`;
  }
  actionsState();
}

const query = new URLSearchParams();
if (jobId) query.set("job", jobId);
if (compare.length) query.set("compare", compare.join(","));
const source = new EventSource(`/events${query.toString() ? `?${query}` : ""}`);
const connection = document.getElementById("connection");
source.addEventListener("board", (message) => {
  connection.textContent = `live, updated ${new Date().toLocaleTimeString()}`;
  show(JSON.parse(message.data));
});
source.onerror = () => { connection.textContent = "reconnecting to the server…"; };
