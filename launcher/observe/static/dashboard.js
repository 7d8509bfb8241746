// The dashboard: reads /api/status and /api/events every second and draws them. No libraries.
"use strict";

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  row.appendChild(td);
}

function fill(tbody, rows, className) {
  tbody.replaceChildren();
  for (const values of rows) {
    const tr = document.createElement("tr");
    if (className) tr.className = className(values);
    for (const value of values) cell(tr, value);
    tbody.appendChild(tr);
  }
}

function polyline(points, color) {
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", color);
  line.setAttribute("stroke-width", "2");
  line.setAttribute("points", points.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
  return line;
}

function chart(samples) {
  const svg = document.getElementById("chart");
  svg.replaceChildren();
  const rates = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = samples[i].at - samples[i - 1].at;
    const ds = samples[i].step - samples[i - 1].step;
    if (dt > 0 && ds >= 0) rates.push([samples[i].at, ds / dt, samples[i].size || 0]);
  }
  if (rates.length < 1) return;
  const t0 = rates[0][0], t1 = Math.max(rates[rates.length - 1][0], t0 + 1);
  const maxRate = Math.max(...rates.map((r) => r[1]), 1e-9);
  const maxSize = Math.max(...rates.map((r) => r[2]), 1);
  const x = (t) => 10 + (580 * (t - t0)) / (t1 - t0);
  svg.appendChild(polyline(rates.map((r) => [x(r[0]), 190 - (170 * r[1]) / maxRate]), "#1565c0"));
  svg.appendChild(polyline(rates.map((r) => [x(r[0]), 190 - (170 * r[2]) / maxSize]), "#ef6c00"));
}

async function refresh() {
  try {
    const [status, events] = await Promise.all([
      fetch("/api/status").then((r) => r.json()),
      fetch("/api/events").then((r) => r.json()),
    ]);
    document.getElementById("job").textContent = status.job_id;
    const phase = document.getElementById("phase");
    phase.textContent = status.phase;
    phase.className = "phase " + status.phase;
    document.getElementById("reason").textContent = status.reason || "";
    const ring = status.ring;
    document.getElementById("epoch").textContent = ring
      ? `epoch ${ring.epoch} (${ring.state}, ${ring.cause}), ${ring.ranks.length} ranks` : "";
    const reported = new Map((status.rank_progress || []).map((p) => [p.slot, p]));
    fill(document.querySelector("#ring tbody"),
      ring ? ring.ranks.map((r) => {
        const p = reported.get(r.slot) || {};
        const seconds = p.step_seconds === null || p.step_seconds === undefined
          ? "" : `${(p.step_seconds * 1000).toFixed(0)} ms`;
        return [r.rank, r.slot, r.node, r.host, p.step, seconds, p.phase || "training"];
      }) : []);
    document.getElementById("sizes").textContent =
      `target ${status.target_workers} nodes (min ${status.min_workers}, max ` +
      `${status.max_workers}); restarts used ${status.restarts_used} of ${status.max_restarts}`;
    const progress = status.progress;
    document.getElementById("progress").textContent = progress
      ? `last commit: step ${progress.step} at size ${progress.size}` : "no commit yet";
    const good = status.goodput;
    document.getElementById("goodput").textContent = good && good.ratio !== null
      ? `goodput ${(100 * good.ratio).toFixed(1)} % (kept ${good.kept_seconds.toFixed(1)} s of ` +
        `${good.wall_seconds.toFixed(0)} s; lost to rollbacks: ${good.rollback_steps} steps, ` +
        `${good.rollback_seconds.toFixed(2)} s)` +
        (good.samples_per_second ? `; ${good.samples_per_second.toFixed(0)} samples/s` : "")
      : "";
    chart(status.throughput || []);
    fill(document.querySelector("#events tbody"),
      events.filter((e) => e.kind !== "Progress").reverse().map((e) => [
        new Date(e.at * 1000).toLocaleTimeString(), e.kind, e.epoch, e.message]),
      (values) => values[1]);
    document.body.dataset.loaded = "true";
  } catch (error) {
    document.getElementById("reason").textContent = `(the launcher does not answer: ${error})`;
  }
}

refresh();
setInterval(refresh, 1000);
