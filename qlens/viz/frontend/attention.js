// AttentionExplorer: the selected head's pattern (and the comparison and difference), a token
// strip that shows attention from or to the hovered token, and every head of the layer.

// Draw an n x n pattern; levelAt(i) gives the palette level (0..255) of cell i = q * n + k.
function drawPattern(canvas, n, levelAt, colours) {
  canvas.width = n;
  canvas.height = n;
  const context = canvas.getContext("2d");
  const image = context.createImageData(n, n);
  const pixels = image.data;
  for (let i = 0; i < n * n; i++) {
    const c = 3 * levelAt(i);
    pixels[4 * i] = colours[c];
    pixels[4 * i + 1] = colours[c + 1];
    pixels[4 * i + 2] = colours[c + 2];
    pixels[4 * i + 3] = 255;
  }
  context.putImageData(image, 0, 0);
}

function cellUnder(event, canvas, n) {
  const box = canvas.getBoundingClientRect();
  const k = Math.floor(((event.clientX - box.left) / box.width) * n);
  const q = Math.floor(((event.clientY - box.top) / box.height) * n);
  return q >= 0 && q < n && k >= 0 && k < n ? [q, k] : null;
}

function render({ model, el }) {
  const started = performance.now();
  const nLayers = model.get("n_layers");
  const nHeads = model.get("n_heads");
  const n = model.get("n_pos");
  const tokens = model.get("tokens");
  const labels = model.get("labels");
  const reference = bytesOf(model.get("patterns"));
  const compared = model.get("compare");
  const other = compared && compared.byteLength ? bytesOf(compared) : null;
  const difference = other ? float16Array(model.get("difference")) : null;
  const size = n * n;
  const offset = () => (model.get("layer") * nHeads + model.get("head")) * size;

  const root = make("div", "qlens-viewer qlens-attention");
  const choose = chooser(model);
  const controls = controlBar();
  const unbind = [
    sliderControl(controls, model, choose, "layer", "layer", 0, nLayers - 1).unbind,
    sliderControl(controls, model, choose, "head", "head", 0, nHeads - 1).unbind,
  ];
  const caption = make("div", "qlens-caption");
  const panels = make("div", "qlens-panels");
  const tip = tooltip(root);
  const sources = [{ label: labels[0], at: (o, i) => reference[o + i] / 255}];
  if (other) {
    sources.push({ label: labels[1], at: (o, i) => other[o + i] / 255});
    sources.push({ label: "difference", at: (o, i) => difference[o + i]});
  }
  const canvases = sources.map((source) => {
    const figure = make("figure", "qlens-panel");
    const canvas = make("canvas", "qlens-pattern");
    figure.append(make("figcaption", "", source.label), canvas);
    panels.appendChild(figure);
    canvas.addEventListener("mousemove", (event) => {
      const cell = cellUnder(event, canvas, n);
      if (!cell) return tip.hide();
      const [q, k] = cell;
      const value = source.at(offset(), q * n + k);
      tip.show(event, `${source.label}: query ${q} ${tokens[q]} → key ${k} ${tokens[k]}: ${formatValue(value)}`);
      highlight(q, "from");
    });
    canvas.addEventListener("mouseleave", () => {
      tip.hide();
      highlight(null);
    });
    return canvas;
  });

  const stripHead = make("div", "qlens-strip-head");
  const mode = make("select", "qlens-mode");
  for (const [value, text] of [["from", "hover shows attention from the token"], ["to", "hover shows attention to the token"]]) {
    const option = make("option", "", text);
    option.value = value;
    mode.appendChild(option);
  }
  stripHead.append(mode);
  const strip = make("div", "qlens-tokens");
  const spans = tokens.map((token, i) => {
    const span = make("span", "qlens-token", token);
    span.dataset.pos = String(i);
    span.addEventListener("mouseenter", () => highlight(i, mode.value));
    span.addEventListener("mouseleave", () => highlight(null));
    strip.appendChild(span);
    return span;
  });

  // Colour every token by its attention from (row) or to (column) the hovered token.
  function highlight(pos, direction) {
    const o = offset();
    spans.forEach((span, j) => {
      span.classList.toggle("qlens-hovered", j === pos);
      if (pos === null) {
        span.style.cssText = "";
        span.title = "";
        return;
      }
      const level = direction === "from" ? reference[o + pos * n + j] : reference[o + j * n + pos];
      span.style.cssText = SEQUENTIAL_STYLES[level];
      span.title = formatValue(level / 255);
    });
  }

  const headsTitle = make("div", "qlens-caption");
  const heads = make("div", "qlens-heads");
  const thumbs = [];
  for (let h = 0; h < nHeads; h++) {
    const figure = make("figure", "qlens-thumb");
    const canvas = make("canvas", "qlens-pattern");
    figure.append(canvas, make("figcaption", "", `head ${h}`));
    figure.addEventListener("click", () => choose({ head: h }));
    heads.appendChild(figure);
    thumbs.push({ figure, canvas });
  }

  function drawHeads() {
    const layer = model.get("layer");
    headsTitle.textContent = `every head of layer ${layer} (${labels[0]}); click one to select it`;
    thumbs.forEach(({ canvas }, h) => {
      const o = (layer * nHeads + h) * size;
      drawPattern(canvas, n, (i) => reference[o + i], SEQUENTIAL_PALETTE);
    });
  }

  function drawSelected() {
    const layer = model.get("layer");
    const head = model.get("head");
    caption.textContent = `layer ${layer} of ${nLayers}, head ${head} of ${nHeads} (query rows, key columns)`;
    const o = offset();
    let bound = 0;
    if (difference) for (let i = 0; i < size; i++) bound = Math.max(bound, Math.abs(difference[o + i]));
    const scale = 127.5 / (bound || 1);
    drawPattern(canvases[0], n, (i) => reference[o + i], SEQUENTIAL_PALETTE);
    if (other) {
      drawPattern(canvases[1], n, (i) => other[o + i], SEQUENTIAL_PALETTE);
      drawPattern(canvases[2], n, (i) => Math.round(127.5 + difference[o + i] * scale), DIVERGING_PALETTE);
    }
    thumbs.forEach(({ figure }, h) => figure.classList.toggle("qlens-selected", h === head));
    root.dataset.layer = String(layer);
    root.dataset.head = String(head);
  }

  root.append(controls, caption, panels, stripHead, strip, headsTitle, heads);
  el.appendChild(root);
  drawHeads();
  drawSelected();
  const showFallback = hideStaticFallback(model);
  markLoaded(root, started);
  const onLayer = () => {
    drawHeads();
    drawSelected();
  };
  model.on("change:layer", onLayer);
  model.on("change:head", drawSelected);
  return () => {
    model.off("change:layer", onLayer);
    model.off("change:head", drawSelected);
    unbind.forEach((off) => off());
    showFallback();
  };
}

export default { render };
