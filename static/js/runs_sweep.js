/* The run page's checkpoint evaluation: the newest evaluation of this run that asked two or more of its
 * checkpoints (a sweep), charted as each metric's mean (with its 95% interval) against the step, the
 * base model as a dashed line, and the best checkpoint by the charted metric marked. "Evaluate all
 * checkpoints" starts one on the run's validation set (its training set when it has none). */
(function () {
  "use strict";
  const { el, api } = window.TD;
  const $ = (id) => document.getElementById(id);
  if (!$("sweep-card")) return;
  const run = JSON.parse($("run-data").textContent);
  const R = window.TDRuns;
  let chart = null;
  let shown = null;

  function sweepOf(list) {
    return list.find((e) => e.subjects.filter((s) => s.sweep && s.run_id === run.id).length >= 2) || null;
  }

  async function load() {
    const list = await api("/api/v1/evaluations?limit=50&run_id=" + encodeURIComponent(run.id));
    shown = sweepOf(list.data);
    render();
    if (shown && (shown.status === "queued" || shown.status === "running")) setTimeout(load, 3000);
  }

  function metricsOf(e) {
    return e.config.metrics.concat(e.config.judge ? ["judge"] : []);
  }

  function render() {
    const e = shown;
    const link = $("sweep-link");
    link.hidden = !e;
    if (!e) return;
    link.href = "/evaluations/" + encodeURIComponent(e.id);
    link.textContent = e.id + " · " + e.status;
    const select = $("sweep-metric");
    const metrics = metricsOf(e);
    if (select.options.length !== metrics.length) {
      select.replaceChildren(...metrics.map((m) => el("option", { value: m }, m)));
      select.value = metrics.includes("exact_match") ? "exact_match" : metrics[0];
    }
    select.hidden = false;
    const m = select.value;
    const points = e.subjects
      .filter((s) => s.sweep && s.run_id === run.id && (e.summary[s.key] || {})[m] && e.summary[s.key][m].n)
      .map((s) => ({ step: s.step, ...e.summary[s.key][m] }))
      .sort((a, b) => a.step - b.step);
    const baseSubject = e.subjects.find((s) => s.kind === "base");
    const baseScore = baseSubject && (e.summary[baseSubject.key] || {})[m];
    $("sweep-empty").hidden = points.length > 0;
    $("sweep-empty").textContent = e.status === "succeeded" ? "No scores for " + m + "." : "Evaluating " + e.subjects.length + " subjects: the chart appears when it is done.";
    if (!points.length) {
      $("sweep-note").textContent = "";
      return;
    }
    const best = points.reduce((a, b) => (R.evalBetter(m, b.mean, a.mean) ? b : a));
    const score = (v) => R.evalText(m, v) + (R.evalScale(m) === 100 ? "%" : "");
    $("sweep-note").replaceChildren(
      el("span", { id: "sweep-best", dataset: { step: String(best.step) } }, "Best by " + m + ": step " + best.step + " (" + score(best.mean) + ")"),
      baseScore && baseScore.n ? el("span", { className: "muted" }, " · base model " + score(baseScore.mean)) : null,
    );
    const k = R.evalScale(m);
    if (!window.Chart) return;
    const xs = points.map((p) => p.step);
    const datasets = [
      { label: "95% interval (high)", data: points.map((p) => ({ x: p.step, y: k * p.high })), borderWidth: 0, pointRadius: 0, fill: false },
      { label: "95% interval", data: points.map((p) => ({ x: p.step, y: k * p.low })), borderWidth: 0, pointRadius: 0, fill: "-1", backgroundColor: "rgba(79, 70, 229, 0.15)" },
      {
        label: m, data: points.map((p) => ({ x: p.step, y: k * p.mean })), borderColor: "#4f46e5", backgroundColor: "#4f46e5", tension: 0,
        pointRadius: points.map((p) => (p === best ? 7 : 3.5)), pointBackgroundColor: points.map((p) => (p === best ? "#16a34a" : "#4f46e5")),
      },
    ];
    if (baseScore && baseScore.n) {
      datasets.push({ label: "base model", data: [{ x: Math.min(...xs), y: k * baseScore.mean }, { x: Math.max(...xs), y: k * baseScore.mean }],
        borderColor: "#d97706", borderDash: [6, 4], pointRadius: 0, borderWidth: 1.5 });
    }
    const options = { animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { type: "linear", title: { display: true, text: "step" } }, y: { beginAtZero: k === 100, max: k === 100 ? 100 : undefined, title: { display: true, text: R.evalAxis(m) } } },
      plugins: { legend: { display: true, position: "top", align: "end", labels: { filter: (item) => item.text !== "95% interval (high)" } } } };
    if (chart) chart.destroy();
    chart = new window.Chart($("sweep-chart"), { type: "line", data: { datasets }, options });
  }

  async function start(button) {
    $("sweep-error").hidden = true;
    button.disabled = true;
    try {
      // Its validation split (the records training held out, or its validation dataset), else its data.
      const split = run.validation_dataset_id || run.config.validation_fraction > 0;
      const body = {
        ...(split ? { validation_of: run.id } : { dataset_id: run.dataset_id }),
        subjects: [{ kind: "checkpoints", run_id: run.id }, { kind: "base", run_id: run.id }],
        metrics: ["exact_match", "chrf"],
        max_samples: Number($("sweep-samples").value),
        max_tokens: Number($("sweep-tokens").value),
      };
      const created = await api("/api/v1/evaluations", { method: "POST", json: body });
      window.location.assign("/evaluations/" + encodeURIComponent(created.id));
    } catch (err) {
      $("sweep-error").textContent = "Could not start the evaluation: " + err.message;
      $("sweep-error").hidden = false;
      button.disabled = false;
    }
  }

  $("sweep-metric").addEventListener("change", render);
  $("sweep-start").addEventListener("click", (e) => start(e.currentTarget));
  document.addEventListener("DOMContentLoaded", () => load().catch((err) => {
    $("sweep-error").textContent = err.message;
    $("sweep-error").hidden = false;
  }));
})();
