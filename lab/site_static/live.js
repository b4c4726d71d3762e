// The live calculators: every <div class="live-calc" data-calc="NAME"> that lab/site.py put after a calculator's
// snapshot gets the controls of static/live/NAME.js, once the runtime (lab-calc.js) has started.
//
// live/NAME.js exports mount(element, calc): it draws its controls into `element` and computes with `calc`
// (window.lab.calc). Until it has mounted, the snapshot (the executed notebook's widget, drawn by the html-manager)
// stays; mounted, the snapshot is hidden. When the runtime cannot start (a page opened from file://) or a mount
// throws, the element says so in one line and the snapshot stays.
(function () {
  "use strict";
  const STATIC = new URL(".", document.currentScript.src);

  function say(element, state, text) {
    element.dataset.state = state;
    element.textContent = "";
    const line = document.createElement("p");
    line.className = "live-calc-note";
    line.textContent = text;
    element.append(line);
  }

  // The snapshot: the outputs of the cell just before the element that hold a widget (site.html.j2 captions them).
  function snapshots(element) {
    const cell = element.previousElementSibling;
    if (!cell) return [];
    const outputs = [...cell.querySelectorAll(".jp-OutputArea-child")];
    return outputs.filter((output) => output.querySelector(".jupyter-widgets"));
  }

  async function mountOne(element) {
    const name = element.dataset.calc;
    say(element, "loading", "loading the live calculator…");
    try {
      await window.lab.ready;
    } catch (error) {
      say(element, "offline", error.message);
      return;
    }
    try {
      const module = await import(new URL(`live/${name}.js`, STATIC).href);
      element.textContent = "";
      await module.mount(element, window.lab.calc);
    } catch (error) {
      say(element, "error", `the live ${name} calculator failed: ${String(error && error.message || error).split("\n")[0]}`);
      return;
    }
    element.dataset.state = "live";
    for (const snapshot of snapshots(element)) snapshot.style.display = "none";  // not `hidden`: the CSS sets display
  }

  function mountAll() {
    document.querySelectorAll(".live-calc").forEach(mountOne);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", mountAll);
  else mountAll();
}());
