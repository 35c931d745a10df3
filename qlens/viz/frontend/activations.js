// ActivationHeatmap: the tokens of the sequence coloured by the selected neuron or direction.
// Neuron and direction changes re-colour here; a new hook brings new values from the kernel.

function render({ model, el }) {
  const started = performance.now();
  const root = make("div", "qlens-viewer qlens-activations");
  const tip = tooltip(root);
  const choose = chooser(model);
  const groups = model.get("hook_groups"); // [layer, [[kind, name], ...]]
  const kindsOf = (layer) => (groups.find(([l]) => l === layer) || groups[0])[1];
  const placeOf = (name) => {
    for (const [layer, kinds] of groups) for (const [kind, hook] of kinds) if (hook === name) return [layer, kind];
    return [groups[0][0], groups[0][1][0][0]];
  };

  const controls = controlBar();
  const layerSelect = make("select", "qlens-select");
  layerSelect.dataset.trait = "hook-layer";
  layerSelect.innerHTML = groups.map(([layer]) => `<option>${escapeHtml(layer)}</option>`).join("");
  const kindSelect = make("select", "qlens-select");
  kindSelect.dataset.trait = "hook-kind";
  labelled(controls, "layer", layerSelect);
  labelled(controls, "kind", kindSelect);
  // A new layer keeps the kind where that layer has it, else takes its first.
  layerSelect.addEventListener("change", () => {
    const kinds = kindsOf(layerSelect.value);
    const kind = placeOf(model.get("hook"))[1];
    choose({ hook: (kinds.find(([k]) => k === kind) || kinds[0])[1] });
  });
  kindSelect.addEventListener("change", () => {
    const hook = kindsOf(layerSelect.value).find(([k]) => k === kindSelect.value);
    if (hook) choose({ hook: hook[1] });
  });
  let kindsShown = null;
  function showHook() {
    const [layer, kind] = placeOf(model.get("hook"));
    if (kindsShown !== layer) {
      kindSelect.innerHTML = kindsOf(layer).map(([k]) => `<option>${escapeHtml(k)}</option>`).join("");
      kindsShown = layer;
    }
    layerSelect.value = layer;
    kindSelect.value = kind;
    draw();
  }
  const feature = selectControl(controls, model, choose, "feature", "feature", ["neuron", ...model.get("directions")]);
  feature.wrap.hidden = model.get("directions").length === 0;
  const neuron = numberControl(controls, model, choose, "neuron", "neuron", model.get("n_features") - 1);

  const caption = make("div", "qlens-caption");
  const legendSlot = make("div");
  const strip = make("div", "qlens-tokens");
  const message = make("div", "qlens-message");
  root.append(controls, caption, legendSlot, strip, message);
  el.appendChild(root);
  const spans = model.get("tokens").map((token, i) => {
    const span = make("span", "qlens-token", token);
    span.dataset.pos = String(i);
    return span;
  });
  strip.replaceChildren(...spans);
  let values = new Float32Array(0);
  let projections = new Float32Array(0);

  function load() {
    values = float16Array(model.get("values"));
    projections = float32Array(model.get("projections"));
    neuron.input.max = String(model.get("n_features") - 1);
    draw();
  }

  function shown() {
    const nPos = spans.length;
    const selected = model.get("feature");
    if (selected === 0) {
      const width = model.get("n_features");
      const index = Math.min(model.get("neuron"), width - 1);
      return { what: `neuron ${index}`, at: (i) => values[i * width + index], error: "" };
    }
    const name = model.get("directions")[selected - 1];
    const error = model.get("direction_errors")[selected - 1];
    return { what: name, at: (i) => projections[(selected - 1) * nPos + i], error };
  }

  function draw() {
    const view = shown();
    const hook = model.get("shown_hook");
    const waiting = model.get("hook") !== hook;
    neuron.input.disabled = model.get("feature") !== 0;
    caption.textContent = `${hook}: ${view.what}`;
    message.textContent = waiting ? `loading ${model.get("hook")} from the kernel...` : view.error;
    root.dataset.hook = hook;
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
  showHook();
  const showFallback = hideStaticFallback(model);
  markLoaded(root, started);
  // The kernel sends a hook's values, width and projections in one message: load once for it.
  let loadQueued = false;
  const reload = () => {
    if (loadQueued) return;
    loadQueued = true;
    queueMicrotask(() => {
      loadQueued = false;
      load();
    });
  };
  const data = ["change:values", "change:projections", "change:n_features", "change:shown_hook"];
  data.forEach((event) => model.on(event, reload));
  model.on("change:hook", showHook);
  model.on("change:feature", draw);
  model.on("change:neuron", draw);
  return () => {
    data.forEach((event) => model.off(event, reload));
    model.off("change:hook", showHook);
    model.off("change:feature", draw);
    model.off("change:neuron", draw);
    feature.unbind();
    neuron.unbind();
    showFallback();
  };
}

export default { render };
