// Chapter 06's pipeline explorer, live: a schedule played op by op, its bubble, and the activations each rank holds.
// The controls, the Gantt chart and the peaks are lab/widgets/pipeline.py's; the numbers and every op's start and
// end are `python -m lab calc bubble --json` (its "timeline": [rank, kind, micro-batch, chunk, start, end]).
//
// F is drawn in its micro-batch's colour, B darker, W lighter and hatched; the grey behind them is idle time, the
// bubble. Choosing interleaved brings 2 chunks per rank along (and leaving it, 1), as the widget does.

import {axes, chart, el, fmt, legend, live, palette, scale, shade, svg, value} from "./ui.js";

const IDLE = "#e6e6e6";
const DARKER = 0.6;  // B: the widget's _shade
const LIGHTER = 1.55;  // W

const SPECS = [
  {name: "--pp-schedule", label: "schedule", kind: "select",
   options: ["afab", "1f1b", "interleaved", "zb-h1", "zb-h2", "dualpipe"], value: "1f1b"},
  {name: "--pp", label: "pp (ranks)", kind: "number", min: 2, max: 16, step: 1, value: 4},
  {name: "--grad-accum", label: "micro-batches", kind: "number", min: 1, max: 64, step: 1, value: 8},
  {name: "--pp-chunks", label: "chunks (interleaved)", kind: "number", min: 1, max: 8, step: 1, value: 1},
  {name: "--tf", label: "t_f forward", kind: "number", min: 0, max: 4, step: 0.25, value: 1},
  {name: "--tb", label: "t_b backward", kind: "number", min: 0, max: 8, step: 0.25, value: 2},
  {name: "--tw", label: "t_w (part of t_b)", kind: "number", min: 0, max: 4, step: 0.25, value: 1},
  {name: "--p2p", label: "p2p latency", kind: "number", min: 0, max: 2, step: 0.05, value: 0},
];

export async function mount(root, calc) {
  await live(root, calc, {
    specs: SPECS,
    command: "bubble",
    draw,
    onChange: (target, inputs) => {
      if (target !== inputs["--pp-schedule"]) return;
      const chunks = inputs["--pp-chunks"];
      if (target.value === "interleaved" && chunks.value === "1") chunks.value = "2";
      else if (target.value !== "interleaved" && Number(chunks.value) > 1) chunks.value = "1";
    },
  });
}

function draw(answer, values, view) {
  const p = answer.pp;
  const rowHeight = p <= 8 ? 24 : 16;
  const c = chart(760, rowHeight * p + 60, {left: 56, right: 150, top: 8, bottom: 44});
  const x = scale(0, answer.makespan, c.box.left, c.box.right);
  const y = (rank) => c.box.top + rank * rowHeight;
  c.svg.append(svg("rect", {x: c.box.left, y: c.box.top, width: c.box.right - c.box.left,
                            height: c.box.bottom - c.box.top, fill: IDLE}));
  axes(c, x, null, {xlabel: "time (unit of t_f, t_b, t_w)"});
  const colours = palette(answer.microbatches);
  const hatched = answer.timeline.some(([, kind]) => kind === "W");
  if (hatched) c.svg.append(hatch());
  for (const [rank, kind, microbatch, chunk, start, end] of answer.timeline) {
    const colour = colours[microbatch];
    const fill = kind === "B" ? shade(colour, DARKER) : kind === "W" ? shade(colour, LIGHTER) : colour;
    const op = `${kind}${microbatch}${chunk ? `.${chunk}` : ""}`;
    const width = x(end) - x(start);
    const g = svg("g", {class: "live-op", "data-rank": rank, "data-op": op, "data-start": JSON.stringify(start),
                        "data-end": JSON.stringify(end)},
                  svg("rect", {x: x(start), y: y(rank) + 2, width, height: rowHeight - 4, fill,
                               stroke: kind === "W" ? colour : "white", "stroke-width": width > 4 ? 0.5 : 0}),
                  svg("title", {}, `rank ${rank}: ${op}, ${fmt(start)} to ${fmt(end)}`));
    if (kind === "W") g.append(svg("rect", {x: x(start), y: y(rank) + 2, width, height: rowHeight - 4,
                                            fill: "url(#live-hatch)"}));
    const label = op.length * 6.5 <= width - 2 ? op : String(microbatch).length * 6.5 <= width - 2 ? microbatch : "";
    if (label !== "" && rowHeight > 16) {
      g.append(svg("text", {x: x((start + end) / 2), y: y(rank) + rowHeight / 2 + 4, "text-anchor": "middle",
                            class: kind === "B" ? "live-on-dark" : ""}, String(label)));
    }
    c.svg.append(g);
  }
  drawPeaks(c, answer, y, rowHeight);
  for (let rank = 0; rank < p; rank++) {
    c.svg.append(svg("text", {x: c.box.left - 4, y: y(rank) + rowHeight / 2 + 4, "text-anchor": "end"},
                     `rank ${rank}`));
  }
  const grey = "#8c8c8c";
  view.plot.replaceChildren(c.svg, legend([
    ["F forward", grey], [hatched ? "B input grad" : "B backward", shade(grey, DARKER)],
    ...(hatched ? [["W weight grad", shade(grey, LIGHTER)]] : []), ["idle (bubble)", IDLE],
    ["peak activations (micro-batches of a stage)", "#7e57c2"]]));
  summarise(answer, view);
}

function hatch() {  // W's diagonal lines, as the widget's "////"
  return svg("defs", {}, svg("pattern", {id: "live-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                                         patternTransform: "rotate(45)"},
                             svg("line", {x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#555", "stroke-width": 1})));
}

function drawPeaks(c, answer, y, rowHeight) {
  const top = Math.max(...answer.peak_activations) || 1;
  const x0 = c.box.right + 10;
  const w = scale(0, top * 1.4, 0, 130);
  answer.peak_activations.forEach((peak, rank) => {
    c.svg.append(svg("rect", {x: x0, y: y(rank) + 4, width: w(peak), height: rowHeight - 8, fill: "#7e57c2",
                              "data-key": `peak_activations.${rank}`, "data-value": JSON.stringify(peak)}),
                 svg("text", {x: x0 + w(peak) + 3, y: y(rank) + rowHeight / 2 + 4}, fmt(peak)));
  });
}

function summarise(a, view) {
  const holds = a.closed_form_exact ? "holds here" : `holds when ${a.closed_form_exact_when}: not here`;
  const chunks = a.chunks > 1 ? ` with v = ${a.chunks} chunks each` : "";
  view.summary.replaceChildren(el("p", {},
    el("b", {}, "bubble ratio (idle / useful) ", value("bubble_ratio", a.bubble_ratio, fmt(a.bubble_ratio, 4))),
    "; closed form ", value("bubble_ratio_closed_form", a.bubble_ratio_closed_form, fmt(a.bubble_ratio_closed_form, 4)),
    ` from ${a.closed_form} (${holds}). Idle fraction (idle / total) `,
    value("idle_fraction", a.idle_fraction, fmt(a.idle_fraction, 4)), "; makespan ",
    value("makespan", a.makespan, fmt(a.makespan, 4)),
    ` time units for ${a.microbatches} micro-batches on p = ${a.pp} ranks${chunks} (${fmt(Math.max(...a.idle), 4)} `,
    `idle and ${fmt(Math.max(...a.busy), 4)} busy per rank); `,
    value("p2p_messages", a.p2p_messages, a.p2p_messages.toLocaleString("en-US")), " point-to-point messages."));
}
