// Shared by every qlens viewer module (prepended to each one; a module loaded from a string
// cannot import its neighbours). Plain DOM, no dependencies, no network.

const F16_TABLE = (() => {
  const table = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1;
    const exponent = (h >> 10) & 0x1f;
    const mantissa = h & 0x3ff;
    if (exponent === 0) table[h] = sign * mantissa * 2 ** -24;
    else if (exponent === 31) table[h] = mantissa ? NaN : sign * Infinity;
    else table[h] = sign * (1 + mantissa / 1024) * 2 ** (exponent - 15);
  }
  return table;
})();

function bytesOf(value) {
  if (value instanceof DataView || ArrayBuffer.isView(value)) {
    return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  }
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  return new Uint8Array(0);
}

function float16Array(value) {
  const bytes = bytesOf(value);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(bytes.byteLength >> 1);
  for (let i = 0; i < out.length; i++) out[i] = F16_TABLE[view.getUint16(2 * i, true)];
  return out;
}

function float32Array(value) {
  const bytes = bytesOf(value);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(bytes.byteLength >> 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
  return out;
}

function uint32Array(value) {
  const bytes = bytesOf(value);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Uint32Array(bytes.byteLength >> 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getUint32(4 * i, true);
  return out;
}

// Colour maps: sequential (white to dark blue) for non-negative quantities, diverging
// (blue, white, red) centred on 0 for signed ones.
const SEQUENTIAL = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
const DIVERGING = [[5, 48, 97], [67, 147, 195], [247, 247, 247], [214, 96, 77], [103, 0, 31]];

function interpolate(stops, t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
}

function sequentialColour(t) {
  return interpolate(SEQUENTIAL, t);
}

function divergingColour(t) {
  return interpolate(DIVERGING, (t + 1) / 2);
}

// A scale for the given values: sequential from 0 when none is negative, else diverging.
function scaleFor(values) {
  let low = Infinity;
  let high = -Infinity;
  for (const v of values) {
    if (Number.isFinite(v)) {
      low = Math.min(low, v);
      high = Math.max(high, v);
    }
  }
  if (!Number.isFinite(low)) return { signed: false, bound: 1, colour: () => SEQUENTIAL[0] };
  if (low >= 0) {
    const bound = high || 1;
    return { signed: false, bound, colour: (v) => sequentialColour(v / bound) };
  }
  const bound = Math.max(-low, high) || 1;
  return { signed: true, bound, colour: (v) => divergingColour(v / bound) };
}

function css(rgb) {
  return `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;
}

// Dark text on light cells, white text on dark ones (WCAG relative luminance).
function textColour(rgb) {
  const [r, g, b] = rgb.map((c) => {
    const s = c / 255;
    return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.18 ? "#111" : "#fff";
}

function paint(node, rgb) {
  node.style.background = css(rgb);
  node.style.color = textColour(rgb);
}

function make(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatValue(v) {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e4)) return v.toExponential(2);
  return v.toPrecision(3);
}

// A tooltip positioned inside the viewer's root (which is position: relative).
function tooltip(root) {
  const tip = make("div", "qlens-tip");
  tip.hidden = true;
  root.appendChild(tip);
  return {
    show(event, text) {
      const box = root.getBoundingClientRect();
      tip.textContent = text;
      tip.hidden = false;
      tip.style.left = `${event.clientX - box.left + 12}px`;
      tip.style.top = `${event.clientY - box.top + 12}px`;
    },
    hide() {
      tip.hidden = true;
    },
  };
}

// A colour bar: the scale's low and high ends with the quantity's name.
function legend(scale, label) {
  const bar = make("div", "qlens-legend");
  const low = scale.signed ? -scale.bound : 0;
  const ramp = make("span", "qlens-ramp");
  const stops = scale.signed ? DIVERGING : SEQUENTIAL;
  ramp.style.background = `linear-gradient(to right, ${stops.map(css).join(", ")})`;
  bar.append(make("span", "", formatValue(low)), ramp, make("span", "", formatValue(scale.bound)));
  if (label) bar.append(make("span", "qlens-legend-label", label));
  return bar;
}

// Selections made in the browser: `chooser(model)(values)` sets the traits, so the view's change
// listeners redraw at once; the kernel gets the values after the next paint (several choices in
// one frame go as one message).
function chooser(model) {
  let queued = false;
  const save = () => {
    queued = false;
    model.save_changes();
  };
  return (values) => {
    for (const [key, value] of Object.entries(values)) model.set(key, value);
    if (queued) return;
    queued = true;
    if (document.hidden) setTimeout(save, 0);
    else requestAnimationFrame(() => setTimeout(save, 0));
  };
}

// The viewer's own selectors: plain inputs in a bar above the drawing, each bound to a trait.
// Keys pressed in it (arrows on a slider...) stay with its inputs: the notebook's shortcuts
// (arrows select cells) must not take them.
function controlBar() {
  const bar = make("div", "qlens-controls");
  bar.dataset.lmSuppressShortcuts = "true";
  bar.addEventListener("keydown", (event) => event.stopPropagation());
  return bar;
}

// Bind `input` to `trait`: its `event` sets the trait to `read()` (unless null); a change of the
// trait (from the browser or the kernel) shows the value with `write`. Returns the unbinding.
function bind(model, choose, trait, input, event, read, write) {
  input.dataset.trait = trait;
  input.addEventListener(event, () => {
    const value = read();
    if (value !== null && value !== model.get(trait)) choose({ [trait]: value });
  });
  const show = () => write(model.get(trait));
  show();
  model.on(`change:${trait}`, show);
  return () => model.off(`change:${trait}`, show);
}

function labelled(bar, label, ...nodes) {
  const wrap = make("label", "qlens-control");
  wrap.append(make("span", "qlens-control-label", label), ...nodes);
  bar.appendChild(wrap);
  return wrap;
}

// An integer slider in [min, max] with its value shown beside it.
function sliderControl(bar, model, choose, trait, label, min, max) {
  const input = make("input", "qlens-slider");
  Object.assign(input, { type: "range", min: String(min), max: String(max), step: "1" });
  const readout = make("output", "qlens-readout");
  const wrap = labelled(bar, label, input, readout);
  const write = (value) => {
    input.value = String(value);
    readout.textContent = String(value);
  };
  const unbind = bind(model, choose, trait, input, "input", () => Number(input.value), write);
  return { wrap, input, unbind };
}

// A drop-down of `texts` whose trait is the selected index.
function selectControl(bar, model, choose, trait, label, texts) {
  const input = make("select", "qlens-select");
  input.innerHTML = texts.map((text, i) => `<option value="${i}">${escapeHtml(text)}</option>`).join("");
  const wrap = labelled(bar, label, input);
  const write = (value) => {
    input.value = String(value);
  };
  const unbind = bind(model, choose, trait, input, "change", () => Number(input.value), write);
  return { wrap, input, unbind };
}

// An integer box in [0, input.max] (typed values are clamped; the caller may change max).
function numberControl(bar, model, choose, trait, label, max) {
  const input = make("input", "qlens-number");
  Object.assign(input, { type: "number", min: "0", max: String(max), step: "1" });
  const wrap = labelled(bar, label, input);
  const read = () => {
    const value = Math.round(Number(input.value));
    if (input.value === "" || !Number.isFinite(value)) return null;
    return Math.min(Math.max(0, value), Number(input.max));
  };
  const write = (value) => {
    if (Number(input.value) !== value || input.value === "") input.value = String(value);
  };
  const unbind = bind(model, choose, trait, input, "input", read, write);
  return { wrap, input, unbind };
}

function checkboxControl(bar, model, choose, trait, label) {
  const input = make("input", "qlens-checkbox");
  input.type = "checkbox";
  const wrap = labelled(bar, label, input);
  const write = (value) => {
    input.checked = Boolean(value);
  };
  const unbind = bind(model, choose, trait, input, "change", () => input.checked, write);
  return { wrap, input, unbind };
}

// While the view is drawn, hide the static fallback displayed after it (qlens/viz/fallback.py);
// returns the function that shows it again.
function hideStaticFallback(model) {
  const id = model.get("static_id");
  if (!/^[0-9a-f]+$/.test(id)) return () => {};
  const style = make("style");
  const fallback = `.qlens-static[data-view="${id}"]`;
  style.textContent = `.jp-OutputArea-child:has(${fallback}), ${fallback} { display: none; }`;
  document.head.appendChild(style);
  return () => style.remove();
}

// Record on the root how long the first drawing took, up to the next paint (data-load-ms).
function markLoaded(root, started) {
  requestAnimationFrame(() =>
    setTimeout(() => {
      root.dataset.loadMs = (performance.now() - started).toFixed(1);
    }, 0),
  );
}

// Inline styles of the sequential scale at 256 levels, for cells built as HTML text.
const SEQUENTIAL_STYLES = Array.from({ length: 256 }, (_, level) => {
  const rgb = sequentialColour(level / 255);
  return `background:${css(rgb)};color:${textColour(rgb)}`;
});

function sequentialStyle(t) {
  return SEQUENTIAL_STYLES[Math.round(Math.min(1, Math.max(0, t || 0)) * 255)];
}

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

// RGB triples of the sequential and diverging scales at 256 levels, for per-pixel drawing.
function palette(colourOf) {
  const table = new Uint8Array(256 * 3);
  for (let level = 0; level < 256; level++) table.set(colourOf(level / 255), 3 * level);
  return table;
}
const SEQUENTIAL_PALETTE = palette(sequentialColour);
const DIVERGING_PALETTE = palette((t) => divergingColour(2 * t - 1));
