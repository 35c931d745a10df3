// ActivationHeatmap: the tokens of the sequence coloured by the selected neuron or direction.
// Neuron and direction changes re-colour here; a new hook brings new values from the kernel.

function render({ model, el }) {
  const started = performance.now();
  const root = make("div", "qlens-viewer qlens-activations");
  const tip = tooltip(root);
  const caption = make("div", "qlens-caption");
  const legendSlot = make("div");
  const strip = make("div", "qlens-tokens");
  const message = make("div", "qlens-message");
  root.append(caption, legendSlot, strip, message);
  el.appendChild(root);
  let values = new Float32Array(0);
  let projections = new Float32Array(0);
  let spans = [];

  function load() {
    values = float16Array(model.get("values"));
    projections = float32Array(model.get("projections"));
    spans = model.get("tokens").map((token, i) => {
      const span = make("span", "qlens-token", token);
      span.dataset.pos = String(i);
      return span;
    });
    strip.replaceChildren(...spans);
    draw();
  }

  function shown() {
    const nPos = spans.length;
    const feature = model.get("feature");
    if (feature === 0) {
      const width = model.get("n_features");
      const neuron = Math.min(model.get("neuron"), width - 1);
      return { what: `neuron ${neuron}`, at: (i) => values[i * width + neuron], error: "" };
    }
    const name = model.get("directions")[feature - 1];
    const error = model.get("direction_errors")[feature - 1];
    return { what: name, at: (i) => projections[(feature - 1) * nPos + i], error };
  }

  function draw() {
    const view = shown();
    caption.textContent = `${model.get("hook")}: ${view.what}`;
    message.textContent = view.error;
    if (view.error) {
      spans.forEach((span) => paint(span, [238, 238, 238]));
      legendSlot.replaceChildren();
      return;
    }
    const data = spans.map((_, i) => view.at(i));
    const scale = scaleFor(data);
    spans.forEach((span, i) => {
      paint(span, scale.colour(data[i]));
      span.dataset.value = formatValue(data[i]);
    });
    legendSlot.replaceChildren(legend(scale, view.what));
    root.dataset.shown = view.what;
  }

  strip.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".qlens-token");
    if (span) tip.show(event, `${span.dataset.pos} ${span.textContent}: ${span.dataset.value}`);
  });
  strip.addEventListener("mouseleave", () => tip.hide());
  load();
  markLoaded(root, started);
  model.on("change:values", load);
  model.on("change:feature", draw);
  model.on("change:neuron", draw);
  return () => {
    model.off("change:values", load);
    model.off("change:feature", draw);
    model.off("change:neuron", draw);
  };
}

export default { render };
