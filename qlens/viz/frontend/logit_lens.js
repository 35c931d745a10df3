// LogitLensTable: the top-1 grid (layers x positions, scrolling, selected position marked) and
// the top-k table of the selected position. Position clicks and top-k changes stay here.

function render({ model, el }) {
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
  const scroll = make("div", "qlens-scroll");
  const grid = make("table", "qlens-grid");
  const headRow = make("tr");
  headRow.appendChild(make("th", "qlens-corner", "layer \\ position"));
  const columns = tokens.map(() => []);
  tokens.forEach((token, pos) => {
    const th = make("th", "qlens-pos", `${pos}\n${token}`);
    th.addEventListener("click", () => select(model, { position: pos }));
    headRow.appendChild(th);
    columns[pos].push(th);
  });
  const thead = make("thead");
  thead.appendChild(headRow);
  const tbody = make("tbody");
  layers.forEach((label, layer) => {
    const row = make("tr");
    row.appendChild(make("th", "qlens-layer", label));
    for (let pos = 0; pos < nPos; pos++) {
      const p = probs[at(layer, pos, 0)];
      const cell = make("td", "qlens-cell", vocab[ids[at(layer, pos, 0)]]);
      paint(cell, sequentialColour(p));
      cell.dataset.pos = String(pos);
      columns[pos].push(cell);
      row.appendChild(cell);
    }
    tbody.appendChild(row);
  });
  grid.append(thead, tbody);
  grid.addEventListener("click", (event) => {
    const cell = event.target.closest("td.qlens-cell");
    if (cell) select(model, { position: Number(cell.dataset.pos) });
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
  root.append(legendRow, scroll, caption, tableScroll);
  el.appendChild(root);

  let marked = -1;
  function markPosition() {
    const pos = model.get("position");
    if (marked >= 0) for (const node of columns[marked]) node.classList.remove("qlens-selected");
    for (const node of columns[pos]) node.classList.add("qlens-selected");
    marked = pos;
    const header = columns[pos][0];
    const left = header.offsetLeft - scroll.clientWidth / 2;
    if (header.offsetLeft < scroll.scrollLeft || header.offsetLeft + header.offsetWidth > scroll.scrollLeft + scroll.clientWidth) {
      scroll.scrollLeft = Math.max(0, left);
    }
    root.dataset.position = String(pos);
  }

  function drawTable() {
    const pos = model.get("position");
    const k = model.get("top_k");
    caption.textContent = `top ${k} predictions after position ${pos} (${tokens[pos]})`;
    const rows = [make("tr")];
    rows[0].appendChild(make("th", "", "layer"));
    for (let r = 0; r < k; r++) rows[0].appendChild(make("th", "", `#${r + 1}`));
    layers.forEach((label, layer) => {
      const row = make("tr");
      row.appendChild(make("th", "qlens-layer", label));
      for (let r = 0; r < k; r++) {
        const p = probs[at(layer, pos, r)];
        const cell = make("td", "qlens-cell", `${vocab[ids[at(layer, pos, r)]]} ${p.toFixed(2)}`);
        paint(cell, sequentialColour(p));
        row.appendChild(cell);
      }
      rows.push(row);
    });
    topk.replaceChildren(...rows);
    root.dataset.topK = String(k);
  }

  const onPosition = () => {
    markPosition();
    drawTable();
  };
  markPosition();
  drawTable();
  model.on("change:position", onPosition);
  model.on("change:top_k", drawTable);
  return () => {
    model.off("change:position", onPosition);
    model.off("change:top_k", drawTable);
  };
}

export default { render };
