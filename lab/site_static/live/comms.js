// Chapter 02's collective cost, live: the α–β model of `python -m lab calc comms --json` for one collective, and its
// time against the message size for every algorithm the model prices (ring, tree, hierarchical).
//
// The notebook draws this curve with matplotlib for a fitted link; here it is drawn for the cluster you pick. Each
// curve is a number of steps × α plus the bytes each rank sends × β, so two sizes pin the chosen algorithm's two
// terms: the page draws both as dashed asymptotes and shades where each dominates. Left of their crossing a message
// is latency-bound (more bandwidth would not help; fewer steps, a tree, would); right of it, bandwidth-bound.

import {argv, ask, axes, bytes, chart, el, fmt, legend, line, live, scale, seconds, svg, value} from "./ui.js";

const SIZES = Array.from({length: 13}, (_, k) => 2 ** (8 + 2 * k));  // 256 B .. 4 GiB
const ALGORITHMS = [["ring", "#1565c0"], ["tree", "#e65100"], ["hierarchical", "#2e7d32"]];

const SPECS = [
  {name: "--op", label: "collective", kind: "select",
   options: ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send"],
   value: "all_reduce"},
  {name: "--bytes", label: "message size", kind: "text", value: "1GiB",
   title: "bytes: 268435456, 1e9, 256MB (10^6 B), 1GiB (2^30 B)"},
  {name: "--ranks", label: "ranks", kind: "number", min: 1, step: 1, value: 16},
  {name: "--gpus-per-node", label: "GPUs per node", kind: "number", min: 1, step: 1, value: 8},
  {name: "--hardware", label: "cluster", kind: "select", options: ["a100", "h100", "h200", "b200", "cpu"],
   value: "h100"},
  {name: "--algorithm", label: "algorithm", kind: "select", options: ALGORITHMS.map(([name]) => name), value: "ring"},
];

export async function mount(root, calc) {
  await live(root, calc, {specs: SPECS, ask: curves, draw});

  async function curves(values) {
    const chosen = await ask(calc, argv("comms", Object.entries(values)));  // refused input: its one line shows
    const others = Object.entries(values).filter(([flag]) => flag !== "--bytes" && flag !== "--algorithm");
    const lines = await Promise.all(ALGORITHMS.map(([algorithm]) => Promise.all(SIZES.map((size) =>
      ask(calc, argv("comms", [...others, ["--bytes", size], ["--algorithm", algorithm]])))).catch(() => null)));
    // an algorithm the model does not price for this collective answers as another one: keep each curve once
    const seen = new Set();
    const drawn = lines.filter((points) => points && !seen.has(points[0].algorithm) && seen.add(points[0].algorithm));
    return {chosen, lines: drawn};
  }
}

/** The two terms of the α–β model from two sizes of one curve: time = latency + bytes × perByte. */
function terms(points) {
  const [a, b] = [points[0], points[points.length - 1]];
  const perByte = (b.time_s - a.time_s) / (b.bytes - a.bytes);
  return {latency: a.time_s - perByte * a.bytes, perByte};
}

function draw({chosen, lines}, values, view) {
  const c = chart(640, 340, {left: 70, title: "collective time against message size"});
  const x = scale(SIZES[0], SIZES[SIZES.length - 1], c.box.left, c.box.right, 4);
  const times = lines.flatMap((points) => points.map((p) => p.time_s)).concat(chosen.time_s);
  const y = scale(Math.min(...times) / 2, Math.max(...times) * 2, c.box.bottom, c.box.top, 10);
  axes(c, x, y, {xlabel: "message size", ylabel: "time", xfmt: bytes, yfmt: seconds});
  const mine = lines.find((points) => points[0].algorithm === chosen.algorithm);
  let crossover = null;
  if (mine) {
    const {latency, perByte} = terms(mine);
    crossover = perByte > 0 ? latency / perByte : null;
    if (crossover) {
      const at = x(Math.min(Math.max(crossover, SIZES[0]), SIZES[SIZES.length - 1]));
      c.svg.append(
        svg("rect", {x: c.box.left, y: c.box.top, width: at - c.box.left, height: c.box.bottom - c.box.top,
                     fill: "#fff3e0"}),
        svg("text", {x: c.box.left + 6, y: c.box.top + 14}, "α-bound: latency × steps"),
        svg("text", {x: c.box.right - 6, y: c.box.bottom - 8, "text-anchor": "end"}, "β-bound: bytes ÷ bandwidth"),
        svg("line", {x1: at, x2: at, y1: c.box.top, y2: c.box.bottom, stroke: "#9e9e9e", "stroke-dasharray": "2 3",
                     "data-key": "crossover", "data-value": JSON.stringify(crossover)}),
        line(x, y, SIZES.map((b) => [b, latency]), {stroke: "#555", "stroke-dasharray": "5 3"}),
        line(x, y, SIZES.filter((b) => b * perByte >= y.domain[0]).map((b) => [b, b * perByte]),
             {stroke: "#555", "stroke-dasharray": "1 3"}));
    }
  }
  for (const points of lines) {
    const colour = ALGORITHMS.find(([name]) => name === points[0].algorithm)[1];
    c.svg.append(line(x, y, points.map((p) => [p.bytes, p.time_s]), {
      stroke: colour, "stroke-width": points === mine ? 2.6 : 1.4, "data-key": `curve.${points[0].algorithm}`,
      "data-value": JSON.stringify(points.map((p) => p.time_s))}));
  }
  c.svg.append(svg("circle", {cx: x(chosen.bytes), cy: y(chosen.time_s), r: 4.5, class: "live-marker",
                              "data-key": "marker.time_s", "data-value": JSON.stringify(chosen.time_s)}));
  view.plot.replaceChildren(c.svg, legend([
    ...lines.map((points) => [points[0].algorithm, ALGORITHMS.find(([name]) => name === points[0].algorithm)[1]]),
    [`${chosen.algorithm}: steps × α`, "#555", true], [`${chosen.algorithm}: bytes × β`, "#555", true]]));
  summarise(chosen, crossover, view);
}

function summarise(a, crossover, view) {
  const regime = crossover === null ? ""
    : ` Its latency and bandwidth terms are equal at ${bytes(crossover)}: this message is `
      + `${a.bytes < crossover ? "latency" : "bandwidth"}-bound.`;
  view.summary.replaceChildren(el("p", {},
    el("b", {}, `${a.op} of ${bytes(a.bytes)} on ${a.ranks} ranks, ${a.algorithm}: `,
       value("time_s", a.time_s, seconds(a.time_s))),
    ` in `, value("steps", a.steps, String(a.steps)), " steps, ",
    value("bytes_sent_per_rank", a.bytes_sent_per_rank, bytes(a.bytes_sent_per_rank)),
    " sent per rank; algorithm bandwidth ", value("algbw", a.algbw, `${fmt(a.algbw / 1e9)} GB/s`),
    ", bus bandwidth ", value("busbw", a.busbw, `${fmt(a.busbw / 1e9)} GB/s`), `. Over ${a.link}.${regime}`));
}
