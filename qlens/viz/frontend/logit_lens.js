// LogitLensTable: the top-1 grid (layers x positions, scrolling, selected position marked) and
// the top-k table of the selected position. Position clicks and top-k changes stay here.

function render({ model, el }) {
  const started = performance.now();
  const layers = model.get("layer_labels");
  const tokens = model.get("tokens");
  const vocab = model.get("vocab");
  const nRanks = model.get("n_ranks");
  const probs = float16Array(model.get("probs"));
  const ids = uint32Array(model.get("token_ids"));
  const nPos = tokens.length;
  const at = (layer, pos, rank) => (layer * nPos + pos) * nRanks + rank;

  const root = make("div", "qlens-viewer qlens-lens");
  const tip = tooltip(root);
  const choose = chooser(model);
  const controls = controlBar();
  const unbind = [
    selectControl(controls, model, choose, "position", "position", model.get("position_labels")).unbind,
    sliderControl(controls, model, choose, "top_k", "top k", 1, nRanks).unbind,
  ];
  const scroll = make("div", "qlens-scroll qlens-grid-scroll");
  const grid = make("table", "qlens-grid");
  // Thousands of cells: built as one HTML string, coloured from a table of 256 styles.
  const head = tokens.map((token, pos) => `<th class="qlens-pos" data-pos="${pos}">${pos}\n${escapeHtml(token)}</th>`);
  const body = layers.map((label, layer) => {
    const cells = [];
    for (let pos = 0; pos < nPos; pos++) {
      const style = sequentialStyle(probs[at(layer, pos, 0)]);
      cells.push(`<td class="qlens-cell" data-pos="${pos}" style="${style}">${escapeHtml(vocab[ids[at(layer, pos, 0)]])}</td>`);
    }
    return `<tr><th class="qlens-layer">${escapeHtml(label)}</th>${cells.join("")}</tr>`;
  });
  grid.innerHTML = `<thead><tr><th class="qlens-corner">layer \\ position</th>${head.join("")}</tr></thead><tbody>${body.join("")}</tbody>`;
  const headers = Array.from(grid.tHead.rows[0].cells).slice(1);
  const mark = make("div", "qlens-column-mark");
  scroll.appendChild(mark);
  grid.addEventListener("click", (event) => {
    const cell = event.target.closest("td.qlens-cell, th.qlens-pos");
    if (cell) choose({ position: Number(cell.dataset.pos) });
  });
  grid.addEventListener("mouseover", (event) => {
    const cell = event.target.closest("td.qlens-cell");
    if (!cell) return;
    const pos = Number(cell.dataset.pos);
    const layer = cell.parentNode.rowIndex - 1;
    const top = [];
    for (let r = 0; r < Math.min(3, nRanks); r++) {
      top.push(`${vocab[ids[at(layer, pos, r)]]} ${probs[at(layer, pos, r)].toFixed(2)}`);
    }
    tip.show(event, `${layers[layer]}, after ${pos} ${tokens[pos]}: ${top.join(" · ")}`);
  });
  grid.addEventListener("mouseleave", () => tip.hide());
  scroll.appendChild(grid);

  const caption = make("div", "qlens-caption");
  const tableScroll = make("div", "qlens-scroll qlens-topk-scroll");
  const topk = make("table", "qlens-topk");
  tableScroll.appendChild(topk);
  const legendRow = legend({ signed: false, bound: 1 }, "top-1 probability");
  root.append(controls, legendRow, scroll, caption, tableScroll);
  el.appendChild(root);

  // One box outlines the selected column: the grid's cells stay untouched (no restyle or
  // repaint of thousands of cells). Its place is read before anything is written.
  function markPosition() {
    const pos = model.get("position");
    root.dataset.position = String(pos);
    const place = () => {
      const left = headers[pos].offsetLeft;
      const width = headers[pos].offsetWidth;
      mark.style.transform = `translateX(${left}px)`;
      mark.style.width = `${width}px`;
      mark.style.height = `${grid.offsetHeight}px`;
      mark.dataset.pos = String(pos);
      const visible = left >= scroll.scrollLeft && left + width <= scroll.scrollLeft + scroll.clientWidth;
      if (!visible) scroll.scrollLeft = Math.max(0, left - scroll.clientWidth / 2);
    };
    if (headers[pos].offsetWidth) place();
    else requestAnimationFrame(place); // not laid out yet (the first drawing)
  }

  function drawTable() {
    const pos = model.get("position");
    const k = model.get("top_k");
    caption.textContent = `top ${k} predictions after position ${pos} (${tokens[pos]})`;
    const ranks = Array.from({ length: k }, (_, r) => `<th>#${r + 1}</th>`).join("");
    const rows = layers.map((label, layer) => {
      const cells = [];
      for (let r = 0; r < k; r++) {
        const p = probs[at(layer, pos, r)];
        const text = `${escapeHtml(vocab[ids[at(layer, pos, r)]])} ${p.toFixed(2)}`;
        cells.push(`<td class="qlens-cell" style="${sequentialStyle(p)}">${text}</td>`);
      }
      return `<tr><th class="qlens-layer">${escapeHtml(label)}</th>${cells.join("")}</tr>`;
    });
    topk.innerHTML = `<tr><th>layer</th>${ranks}</tr>${rows.join("")}`;
    root.dataset.topK = String(k);
  }

  const onPosition = () => {
    markPosition();
    drawTable();
  };
  markPosition();
  drawTable();
  const showFallback = hideStaticFallback(model);
  markLoaded(root, started);
  model.on("change:position", onPosition);
  model.on("change:top_k", drawTable);
  return () => {
    model.off("change:position", onPosition);
    model.off("change:top_k", drawTable);
    unbind.forEach((off) => off());
    showFallback();
  };
}

export default { render };
