// What the five live calculators share: labelled controls, the loop that asks lab.calc and draws its answer, and
// SVG charts. Each calculator (memory.js, bubble.js, search.js, inference.js, comms.js) is a mount(root, calc) that
// lists its controls, turns their values into `python -m lab calc` argv, and draws the JSON that comes back.
//
// Why the loop looks the way it does: a control change is debounced (a number typed digit by digit asks once), every
// answer carries the generation it was asked for and a stale one is dropped (a slow search must not overwrite the
// answer to a later input), and a refused input shows the CLI's one line while the last good drawing stays.
// Numbers that the charts and tables draw carry their exact JSON value in data-value, so that a reader (and the
// browser tests) can check them against `python -m lab calc ... --json`.

const SVG_NS = "http://www.w3.org/2000/svg";
const DEBOUNCE_MS = 150;

/** An HTML element: el("label", {for: "x"}, "text", child). */
export function el(tag, attrs = {}, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

/** An SVG element, as el(). */
export function svg(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

function fill(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.flat().filter((child) => child !== null && child !== undefined));
  return node;
}

let uid = 0;

/**
 * A form of labelled controls, one per spec: {name, label, kind: "select" | "number" | "text" | "checkbox", value,
 * options (select: values, or [value, text] pairs), min, max, step, title}. Plain HTML, so every control is reached
 * with Tab and named by its label.
 */
export function controls(specs) {
  const form = el("form", {class: "live-controls", autocomplete: "off"});
  form.addEventListener("submit", (event) => event.preventDefault());
  const inputs = {};
  for (const spec of specs) {
    const id = `live-${spec.name}-${uid++}`;
    const input = spec.kind === "select" ? select(spec) : el("input", {
      type: spec.kind, name: spec.name, min: spec.min, max: spec.max, step: spec.step,
      checked: spec.kind === "checkbox" && spec.value, value: spec.kind === "checkbox" ? null : spec.value,
      size: spec.kind === "text" ? 10 : null});
    input.id = id;
    if (spec.title) input.title = spec.title;
    inputs[spec.name] = input;
    form.append(el("label", {for: id, class: `live-control live-${spec.kind}`}, el("span", {}, spec.label), input));
  }
  const values = () => Object.fromEntries(Object.entries(inputs).map(([name, input]) => [
    name, input.type === "checkbox" ? input.checked : input.value]));
  return {form, inputs, values};
}

function select(spec) {
  const input = el("select", {name: spec.name});
  for (const option of spec.options) {
    const [value, text] = Array.isArray(option) ? option : [option, option];
    input.append(el("option", {value, selected: String(value) === String(spec.value)}, String(text)));
  }
  return input;
}

/**
 * Mount a calculator in root: its form, a chart area, a summary and the error line. ask(values, calc) returns the
 * numbers (it may call calc several times); without it, `command` names the one `lab calc` subcommand asked with
 * the form's values as flags. draw(answer, values, view) redraws view.plot and view.summary.
 * Resolves once the defaults are drawn (or refused). view.dataset.answered counts the answers shown so far.
 */
export async function live(root, calc, {specs, command, ask: asker, draw, onChange}) {
  const answerFor = asker || ((values) => ask(calc, argv(command, Object.entries(values))));
  const form = controls(specs);
  const view = {
    plot: el("div", {class: "live-plot"}),
    summary: el("div", {class: "live-summary", "aria-live": "polite"}),
    error: el("p", {class: "live-error", role: "alert", hidden: true}),
  };
  const box = el("div", {class: "live-ui", "data-answered": "0"}, form.form,
                 el("div", {class: "live-output"}, view.plot, view.summary, view.error));
  root.append(box);
  let generation = 0;
  let timer = null;

  async function run() {
    const mine = ++generation;
    const values = form.values();
    box.dataset.busy = "true";
    let answer = null;
    let failure = null;
    try {
      answer = await answerFor(values, calc);
    } catch (error) {
      failure = error;
    }
    if (mine !== generation) return;  // a later input is on its way: this answer is stale
    if (failure) {
      view.error.textContent = oneLine(failure);
      view.error.hidden = false;
    } else {
      view.error.hidden = true;
      view.error.textContent = "";
      draw(answer, values, view);
    }
    delete box.dataset.busy;
    box.dataset.answered = String(Number(box.dataset.answered) + 1);
  }

  form.form.addEventListener("change", (event) => {
    if (onChange) onChange(event.target, form.inputs);
    clearTimeout(timer);
    timer = setTimeout(run, DEBOUNCE_MS);
  });
  await run();
}

function oneLine(error) {
  return String(error && error.message || error).trim().split("\n").pop();
}

/** argv for `python -m lab calc`: [sub, "--flag", value, ...] from pairs; a false or null value leaves its flag out,
 * true writes the flag alone. An emptied field stays in ("--pp", ""): the CLI says what it needs, rather than
 * computing its own default unasked. */
export function argv(sub, pairs) {
  const out = [sub];
  for (const [flag, value] of pairs) {
    if (value === true) out.push(flag);
    else if (value !== false && value !== null && value !== undefined) out.push(flag, String(value));
  }
  return out;
}

/** calc(argv) parsed. */
export async function ask(calc, args) {
  return JSON.parse(await calc(args));
}

// --- numbers as text ----------------------------------------------------------------------------------------------

export const GiB = 2 ** 30;

/** 3 significant digits with thousands separators: 1,234 or 0.0123. */
export function fmt(x, digits = 3) {
  if (!Number.isFinite(x)) return String(x);
  if (x !== 0 && Math.abs(x) >= 10 ** digits) return Math.round(x).toLocaleString("en-US");
  return Number(x.toPrecision(digits)).toLocaleString("en-US", {maximumFractionDigits: 12});
}

/** Seconds in the unit that reads best: 4.95 ms, 18.4 µs, 1.2 s. */
export function seconds(s) {
  if (s >= 1) return `${fmt(s)} s`;
  if (s >= 1e-3) return `${fmt(s * 1e3)} ms`;
  return `${fmt(s * 1e6)} µs`;
}

/** Bytes in binary units: 256 MiB, 1 KiB, 80 GiB. */
export function bytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) {
    b /= 1024;
    i += 1;
  }
  return `${fmt(b)} ${units[i]}`;
}

/** A number shown as text that keeps its exact JSON value: <span data-key=key data-value=value>text</span>. */
export function value(key, x, text = fmt(x)) {
  return el("span", {"data-key": key, "data-value": JSON.stringify(x)}, text);
}

// --- charts -------------------------------------------------------------------------------------------------------

/** A map from [lo, hi] to [a, b] pixels: linear, or logarithmic when log is a base (10; 4 for sizes in bytes, whose
 * ticks then fall on 1 KiB, 16 KiB, ...). .ticks() gives round values inside the domain. */
export function scale(lo, hi, a, b, log = 0) {
  const f = log ? Math.log : (x) => x;
  const [flo, fhi] = [f(lo), f(hi)];
  const map = (x) => a + (f(x) - flo) / (fhi - flo || 1) * (b - a);
  map.domain = [lo, hi];
  map.ticks = () => log ? logTicks(lo, hi, log) : linearTicks(lo, hi);
  return map;
}

function linearTicks(lo, hi) {
  const rough = (hi - lo) / 5 || 1;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((k) => k * power).find((s) => s >= rough);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function logTicks(lo, hi, base) {
  const log = (x) => Math.log(x) / Math.log(base);
  const first = Math.ceil(log(lo) - 1e-9);
  const last = Math.floor(log(hi) + 1e-9);
  const every = Math.max(1, Math.ceil((last - first + 1) / 8));
  const ticks = [];
  for (let k = first; k <= last; k += every) ticks.push(base ** k);
  return ticks;
}

/** An empty chart: an <svg> of width x height with a frame, and its inner box {left, right, top, bottom}. */
export function chart(width, height, {left = 64, right = 16, top = 16, bottom = 44, title = ""} = {}) {
  const root = svg("svg", {class: "live-chart", viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
                           "aria-label": title});
  if (title) root.append(svg("title", {}, title));
  return {svg: root, box: {left, right: width - right, top, bottom: height - bottom}};
}

/** Axes on a chart: ticks, grid and labels for scales x and y (either may be null: no axis). */
export function axes(c, x, y, {xlabel = "", ylabel = "", xfmt = fmt, yfmt = fmt} = {}) {
  const {left, right, top, bottom} = c.box;
  const g = svg("g", {class: "live-axes"});
  if (x) {
    for (const t of x.ticks()) {
      g.append(svg("line", {x1: x(t), x2: x(t), y1: top, y2: bottom, class: "live-grid"}),
               svg("text", {x: x(t), y: bottom + 14, "text-anchor": "middle"}, xfmt(t)));
    }
    g.append(svg("text", {x: (left + right) / 2, y: bottom + 32, "text-anchor": "middle", class: "live-label"},
                 xlabel));
  }
  if (y) {
    for (const t of y.ticks()) {
      g.append(svg("line", {x1: left, x2: right, y1: y(t), y2: y(t), class: "live-grid"}),
               svg("text", {x: left - 4, y: y(t) + 4, "text-anchor": "end"}, yfmt(t)));
    }
    g.append(svg("text", {x: 12, y: (top + bottom) / 2, "text-anchor": "middle", class: "live-label",
                          transform: `rotate(-90 12 ${(top + bottom) / 2})`}, ylabel));
  }
  g.append(svg("rect", {x: left, y: top, width: right - left, height: bottom - top, class: "live-frame"}));
  c.svg.append(g);
  return g;
}

/** A polyline through points [[x, y], ...] in data units. */
export function line(x, y, points, attrs = {}) {
  return svg("polyline", {points: points.map(([px, py]) => `${x(px).toFixed(2)},${y(py).toFixed(2)}`).join(" "),
                          fill: "none", ...attrs});
}

/** A legend under (or beside) a chart: [label, colour, dashed?] entries, as HTML. */
export function legend(entries) {
  return el("ul", {class: "live-legend"}, entries.map(([label, colour, dashed]) => el("li", {},
    el("span", {class: dashed ? "live-swatch live-dashed" : "live-swatch", style: `--swatch: ${colour}`}), label)));
}

/** One colour per micro-batch as "#rrggbb": matplotlib's tab20 (the notebook's widgets) up to 20, then a hue wheel. */
const TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
               "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
               "#17becf", "#9edae5"];

export function palette(n) {
  return Array.from({length: n}, (_, i) => n <= 20 ? TAB20[i] : hue(0.85 * i / (n - 1)));
}

function hue(h) {  // a saturated colour at h (0..1 of the wheel), as HSL(h, 70 %, 50 %)
  const channel = (k) => 0.5 - 0.35 * Math.max(-1, Math.min(k - 3, 9 - k, 1));
  const rgb = [0, 8, 4].map((n) => channel((n + h * 12) % 12));
  return `#${rgb.map((v) => Math.round(v * 255).toString(16).padStart(2, "0")).join("")}`;
}

/** "#rrggbb" scaled towards black (k < 1) or mixed towards white (k > 1, by k - 1). */
export function shade(colour, k) {
  const rgb = [1, 3, 5].map((i) => parseInt(colour.slice(i, i + 2), 16));
  const out = rgb.map((v) => k <= 1 ? v * k : v + (255 - v) * (k - 1));
  return `#${out.map((v) => Math.round(v).toString(16).padStart(2, "0")).join("")}`;
}
