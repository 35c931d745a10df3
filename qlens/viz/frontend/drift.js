// DriftDashboard: the selected metric per layer (an SVG line) or per layer and head (a heatmap
// table), on a linear or log scale. Metric and scale changes stay in the browser.

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function logTicks(low, high) {
  const ticks = [];
  for (let e = Math.floor(Math.log10(low)); e <= Math.ceil(Math.log10(high)); e++) ticks.push(10 ** e);
  return ticks;
}

function linearTicks(low, high) {
  const span = high - low || Math.abs(high) || 1;
  const step = 10 ** Math.floor(Math.log10(span / 4));
  const unit = [1, 2, 5, 10].map((m) => m * step).find((s) => span / s <= 6) || step * 10;
  const ticks = [];
  for (let t = Math.ceil(low / unit) * unit; t <= high + unit * 1e-9; t += unit) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function lineChart(labels, values, name, log, tip) {
  const width = 640;
  const height = 260;
  const margin = { left: 64, right: 16, top: 16, bottom: 56 };
  const finite = values.filter((v) => Number.isFinite(v) && (!log || v > 0));
  let low = Math.min(...finite);
  let high = Math.max(...finite);
  if (low === high) {
    low -= Math.abs(low) * 0.1 || 1;
    high += Math.abs(high) * 0.1 || 1;
  }
  const f = log ? Math.log10 : (v) => v;
  const y = (v) => margin.top + (1 - (f(v) - f(low)) / (f(high) - f(low))) * (height - margin.top - margin.bottom);
  const step = (width - margin.left - margin.right) / Math.max(1, labels.length - 1);
  const x = (i) => margin.left + i * step;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "qlens-chart", role: "img" });
  for (const t of log ? logTicks(low, high) : linearTicks(low, high)) {
    if (t < low * (log ? 0.999 : 1) - 1e-12 || t > high * 1.001 + 1e-12) continue;
    chart.append(
      svg("line", { x1: margin.left, x2: width - margin.right, y1: y(t), y2: y(t), class: "qlens-gridline" }),
      svg("text", { x: margin.left - 6, y: y(t) + 4, "text-anchor": "end", class: "qlens-tick" }, formatValue(t)),
    );
  }
  const every = Math.max(1, Math.ceil(labels.length / 16));
  labels.forEach((label, i) => {
    if (i % every) return;
    chart.append(svg("text", { x: x(i), y: height - margin.bottom + 16, "text-anchor": "middle", class: "qlens-tick" }, label));
  });
  chart.append(
    svg("text", { x: (width + margin.left) / 2, y: height - 8, "text-anchor": "middle", class: "qlens-axis" }, "layer"),
    svg("text", { x: 14, y: height / 2, transform: `rotate(-90 14 ${height / 2})`, "text-anchor": "middle", class: "qlens-axis" }, name + (log ? " (log)" : "")),
  );
  const points = values.map((v, i) => (Number.isFinite(v) && (!log || v > 0) ? `${x(i)},${y(v)}` : null)).filter(Boolean);
  chart.append(svg("polyline", { points: points.join(" "), class: "qlens-line" }));
  values.forEach((v, i) => {
    if (!Number.isFinite(v) || (log && v <= 0)) return;
    const dot = svg("circle", { cx: x(i), cy: y(v), r: 4, class: "qlens-dot" });
    dot.addEventListener("mouseenter", (event) => tip.show(event, `layer ${labels[i]}: ${formatValue(v)}`));
    dot.addEventListener("mouseleave", () => tip.hide());
    chart.append(dot);
  });
  return chart;
}

function matrixTable(labels, rows, name, log, tip) {
  const flat = rows.flat();
  const positive = flat.filter((v) => v > 0);
  const floor = positive.length ? Math.min(...positive) : 1;
  const shownValue = (v) => (log ? Math.log10(Math.max(v, floor)) : v);
  let scale;
  if (log) {
    const low = Math.log10(floor);
    const high = Math.log10(Math.max(...flat, floor));
    const span = high - low || 1;
    scale = { signed: false, bound: high, colour: (v) => sequentialColour((v - low) / span) };
  } else {
    scale = scaleFor(flat);
  }
  const wrap = make("div", "qlens-scroll");
  const table = make("table", "qlens-grid qlens-matrix");
  const head = make("tr");
  head.appendChild(make("th", "qlens-corner", "layer \\ head"));
  rows[0].forEach((_, h) => head.appendChild(make("th", "", String(h))));
  table.appendChild(make("thead")).appendChild(head);
  rows.forEach((row, layer) => {
    const tr = make("tr");
    tr.appendChild(make("th", "qlens-layer", labels[layer]));
    row.forEach((v, h) => {
      const cell = make("td", "qlens-cell", formatValue(v));
      paint(cell, scale.colour(shownValue(v)));
      cell.addEventListener("mouseenter", (event) => tip.show(event, `${name}, layer ${labels[layer]}, head ${h}: ${formatValue(v)}`));
      cell.addEventListener("mouseleave", () => tip.hide());
      tr.appendChild(cell);
    });
    table.appendChild(tr);
  });
  wrap.appendChild(table);
  const key = log ? { signed: false, bound: Math.max(...flat, floor) } : scale;
  const bar = legend(key, log ? `${name} (log colour scale)` : name);
  const box = make("div");
  box.append(bar, wrap);
  return box;
}

function render({ model, el }) {
  const started = performance.now();
  const root = make("div", "qlens-viewer qlens-drift");
  const tip = tooltip(root);
  const labels = model.get("layer_labels");
  const series = model.get("series");
  const matrices = model.get("matrices");
  const metrics = model.get("metrics");
  const choose = chooser(model);
  const controls = controlBar();
  const metric = selectControl(controls, model, choose, "metric", "metric", metrics);
  const logScale = checkboxControl(controls, model, choose, "log_scale", "log scale");
  const caption = make("div", "qlens-caption");
  const plot = make("div", "qlens-plot");
  const summary = make("div", "qlens-summary");
  root.append(controls, caption, plot, summary);
  el.appendChild(root);
  summary.textContent = Object.entries(model.get("scalars"))
    .map(([k, v]) => `${k} = ${formatValue(v)}`)
    .join(" · ");

  function draw() {
    const name = metrics[model.get("metric")];
    const allowed = model.get("log_allowed")[model.get("metric")];
    const log = model.get("log_scale") && allowed;
    logScale.input.disabled = !allowed;
    if (name in series) {
      caption.textContent = `${name} per layer`;
      plot.replaceChildren(lineChart(labels, series[name], name, log, tip));
    } else {
      caption.textContent = `${name} per layer (rows) and head (columns)`;
      plot.replaceChildren(matrixTable(labels, matrices[name], name, log, tip));
    }
    root.dataset.metric = name;
    root.dataset.log = String(Boolean(log));
  }

  draw();
  const showFallback = hideStaticFallback(model);
  markLoaded(root, started);
  model.on("change:metric", draw);
  model.on("change:log_scale", draw);
  return () => {
    model.off("change:metric", draw);
    model.off("change:log_scale", draw);
    metric.unbind();
    logScale.unbind();
    showFallback();
  };
}

export default { render };
