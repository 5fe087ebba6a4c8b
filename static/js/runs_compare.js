/* Compare runs: their metric curves on one chart (one colour per run), outcome and cost side by side,
 * and a configuration table that highlights the settings that differ. Runs still in progress are
 * followed by polling their metrics. */
(function () {
  "use strict";
  const { el, api, fmtNum } = window.TD;
  const R = window.TDRuns;
  const $ = (id) => document.getElementById(id);

  let runs = JSON.parse($("runs-data").textContent) || [];
  if (!runs.length || !$("compare-chart")) return;

  const colorOf = {};
  runs.forEach((r, i) => { colorOf[r.id] = R.color(i); });
  const rowsOf = {}; // run id -> metric rows [{step, loss, ...}] in arrival order
  let pools = {};
  const metricSelect = $("compare-metric");

  const METRIC_LABELS = { loss: "train loss", eval_loss: "eval loss", learning_rate: "learning rate", tokens_per_s: "tokens / s" };

  // ---------- chart ----------
  let chart = null;

  function seriesFor(run, key) {
    const out = [];
    R.appendPoints(out, R.pointsOf(rowsOf[run.id] || [], key), key === "eval_loss");
    return out;
  }

  function renderChart() {
    if (!window.Chart) return;
    const key = metricSelect.value;
    const isEval = key === "eval_loss";
    const datasets = runs.map((r) => R.lineDataset(r.id + " · " + r.pool, colorOf[r.id], {
      data: seriesFor(r, key),
      pointRadius: isEval ? 3 : 0,
      borderWidth: 2,
      runId: r.id,
    }));
    const any = datasets.some((d) => d.data.length);
    $("compare-empty").hidden = any;
    if (chart) {
      chart.data.datasets = datasets;
      chart.options.scales.y.title.text = METRIC_LABELS[key] || key;
      chart.update("none");
      return;
    }
    chart = new window.Chart($("compare-chart"), {
      type: "line",
      data: { datasets },
      options: R.lineOptions({
        plugins: {
          legend: { display: true, position: "top", align: "start" },
          tooltip: { callbacks: { label: (item) => item.dataset.label + ": " + R.fmtMetric(item.parsed.y, 6) } },
        },
        scales: { y: { title: { display: true, text: METRIC_LABELS[key] || key, color: "#64708a" } } },
      }),
    });
  }

  metricSelect.addEventListener("change", renderChart);

  // ---------- tables ----------
  function headRow() {
    return el("tr", {}, el("th", { className: "key-col" }, ""), runs.map((r) =>
      el("th", { className: "run-col" },
        el("div", { className: "run-head" },
          el("span", { className: "swatch", style: "background:" + colorOf[r.id] }),
          el("a", { className: "mono", href: "/runs/" + encodeURIComponent(r.id) }, r.id)),
        el("div", { className: "run-head-sub" }, R.runPill(r.status), r.suffix ? el("span", { className: "muted" }, r.suffix) : null))));
  }

  function summaryRows() {
    const final = (r) => {
      const s = seriesFor(r, "loss");
      return s.length ? s[s.length - 1].y : null;
    };
    const bestEval = (r) => {
      const s = seriesFor(r, "eval_loss");
      return s.length ? Math.min(...s.map((p) => p.y)) : null;
    };
    const dur = (r) => R.elapsed(r.started_at, r.finished_at);
    const spec = [
      ["Pool", (r) => r.pool, (r) => {
        const p = pools[r.pool];
        return el("span", {}, el("b", {}, r.pool), p ? el("span", { className: "muted" }, " · " + p.accelerator) : null);
      }],
      ["Chips × price", null, (r) => {
        const p = pools[r.pool];
        return p ? p.chips + " × $" + Number(p.price_per_chip_hour).toFixed(2) + " / chip-hour" : "–";
      }],
      ["Steps", null, (r) => fmtNum(r.step) + " / " + (r.total_steps ? fmtNum(r.total_steps) : "?")],
      ["Duration", dur, (r) => (dur(r) === null ? "–" : R.fmtDuration(dur(r)))],
      ["Final train loss", final, (r) => R.fmtMetric(final(r))],
      ["Best eval loss", bestEval, (r) => R.fmtMetric(bestEval(r))],
      ["Cost", (r) => r.cost_usd, (r) => el("b", {}, R.fmtUSD(r.cost_usd))],
      ["Model", null, (r) => (r.fine_tuned_model ? el("code", { className: "small" }, r.fine_tuned_model) : el("span", { className: "faint" }, "–"))],
    ];
    const lowerIsBetter = ["Duration", "Final train loss", "Best eval loss", "Cost"];
    return spec.map(([label, value, show]) => {
      let best = null;
      if (value && lowerIsBetter.includes(label)) {
        const vals = runs.map(value).filter((v) => typeof v === "number");
        if (vals.length >= 2 && new Set(vals).size > 1) best = Math.min(...vals);
      }
      return el("tr", { dataset: { key: label } }, el("th", { className: "key-col", scope: "row" }, label),
        runs.map((r) => el("td", { className: best !== null && value(r) === best ? "best" : null }, show(r))));
    });
  }

  function renderSummary() {
    $("summary-table").tHead.replaceChildren(headRow());
    $("summary-table").tBodies[0].replaceChildren(...summaryRows());
  }

  const TOP_KEYS = ["base_model", "dataset_id", "validation_dataset_id", "pool", "suffix"];

  function diffRows() {
    const keys = R.configKeys(...runs.map((r) => r.config));
    const rows = [];
    const add = (key, label, get, group) => {
      const values = runs.map(get);
      const differ = new Set(values.map((v) => JSON.stringify(v === undefined ? null : v))).size > 1;
      rows.push({ key, label, values, differ, group });
    };
    TOP_KEYS.forEach((k) => add(k, k, (r) => r[k], "run"));
    keys.forEach((k) => add(k, k, (r) => (r.config || {})[k], "config"));
    return rows;
  }

  function renderDiff() {
    const showAll = $("show-all-keys").checked;
    const rows = diffRows();
    const differing = rows.filter((r) => r.differ).length;
    $("diff-summary").textContent = differing === 0
      ? "identical settings"
      : differing + " of " + rows.length + " settings " + (differing === 1 ? "differs" : "differ");
    $("diff-table").tHead.replaceChildren(headRow());
    const body = rows.filter((r) => showAll || r.differ).map((r) =>
      el("tr", { className: (r.differ ? "diff" : "") + " group-" + r.group, dataset: { key: r.key } },
        el("th", { className: "key-col mono", scope: "row" },
          r.group === "config" ? el("span", { className: "faint" }, "config.") : null, r.label),
        r.values.map((v) => {
          if (r.key === "dataset_id" || r.key === "validation_dataset_id") {
            return el("td", { className: "mono" }, v ? el("a", { href: "/datasets/" + encodeURIComponent(v) }, v) : "–");
          }
          return el("td", { className: "mono" }, R.fmtValue(v));
        })));
    if (!body.length) {
      body.push(el("tr", { className: "empty" }, el("td", { colspan: runs.length + 1 },
        "No differences: these runs used the same settings. Tick “Show all keys” to see them.")));
    }
    $("diff-table").tBodies[0].replaceChildren(...body);
  }

  $("show-all-keys").addEventListener("change", renderDiff);

  // ---------- evaluations ----------
  // One table per eval set (the same records): a row per evaluated checkpoint or base model, each metric's
  // mean [95% interval] (the best marked), its evaluation's cost, then the run settings that differ.
  function evalSetTable(set) {
    const keys = Object.keys(set.config_differences);
    const best = {};
    set.metrics.forEach((m) => {
      const means = set.rows.map((r) => (r.scores[m] ? r.scores[m].mean : null)).filter((v) => v !== null);
      if (means.length >= 2 && new Set(means).size > 1) best[m] = means.reduce((a, b) => (R.evalBetter(m, a, b) ? a : b));
    });
    const head = el("tr", {}, el("th", {}, "Subject"),
      set.metrics.map((m) => el("th", { className: "num" }, R.evalAxis(m))),
      el("th", { className: "num" }, "Evaluation cost"),
      keys.map((k) => el("th", { className: "mono diff-col" }, k)));
    const body = set.rows.map((r) => el("tr", { dataset: { run: r.run_id || "", step: r.step === null ? "" : String(r.step), kind: r.kind } },
      el("td", {}, r.run_id
        ? el("span", {}, el("a", { className: "mono", href: "/runs/" + encodeURIComponent(r.run_id) }, r.run_id), " step " + r.step)
        : el("span", {}, r.label)),
      set.metrics.map((m) => {
        const s = r.scores[m];
        return el("td", { className: "num" + (s && best[m] === s.mean ? " best" : ""), dataset: { metric: m } },
          s ? R.evalText(m, s.mean) + " [" + R.evalText(m, s.low) + "–" + R.evalText(m, s.high) + "]" : "–");
      }),
      el("td", { className: "num" }, el("a", { href: "/evaluations/" + encodeURIComponent(r.evaluation_id) },
        R.fmtUSD(r.cost_usd)), el("span", { className: "muted small" }, " · " + (r.chip_seconds / 3600).toFixed(3) + " chip-h")),
      keys.map((k) => el("td", { className: "mono diff-col", dataset: { key: k } },
        r.run_id ? R.fmtValue(set.config_differences[k][r.run_id]) : el("span", { className: "faint" }, "–")))));
    return el("div", { className: "eval-set", dataset: { evalSet: set.eval_set } },
      el("h3", { className: "small" }, set.label),
      el("div", { className: "table-wrap" }, el("table", { className: "table compact eval-compare-table" }, el("thead", {}, head), el("tbody", {}, body))));
  }

  async function loadEvaluations() {
    const box = $("evals-body");
    if (!box) return;
    try {
      const found = await api("/api/v1/evaluations/compare?run_ids=" + runs.map((r) => encodeURIComponent(r.id)).join(","));
      box.replaceChildren(...(found.data.length
        ? found.data.map(evalSetTable)
        : [el("div", { className: "placeholder", id: "evals-empty" },
          "None of these runs has a finished evaluation: evaluate their checkpoints on one eval set to compare them here.")]));
    } catch (err) {
      box.replaceChildren(el("div", { className: "alert alert-error" }, "Could not load the evaluations: " + err.message));
    }
  }

  // ---------- data ----------
  // All rows each time: an eval row for step N can be recorded after step N+1's training row, so
  // reading only `since_step` would miss it.
  async function loadMetrics(run) {
    const list = await api("/api/v1/runs/" + encodeURIComponent(run.id) + "/metrics");
    rowsOf[run.id] = list.data;
  }

  async function loadPools() {
    try {
      const list = await api("/api/v1/pools");
      pools = Object.fromEntries(list.data.map((p) => [p.name, p]));
    } catch (_) {
      pools = {};
    }
  }

  function renderAll() {
    renderChart();
    renderSummary();
    renderDiff();
  }

  async function poll() {
    const active = runs.filter((r) => !R.isTerminal(r.status));
    if (!active.length) return;
    try {
      const fresh = await Promise.all(active.map((r) => api("/api/v1/runs/" + encodeURIComponent(r.id))));
      runs = runs.map((r) => fresh.find((f) => f.id === r.id) || r);
      await Promise.all(active.map(loadMetrics));
      renderAll();
    } catch (err) {
      console.warn("compare refresh failed", err);
    }
    setTimeout(poll, 3000);
  }

  renderDiff();
  renderSummary();
  loadEvaluations();
  Promise.all([loadPools(), ...runs.map((r) => loadMetrics(r).catch((err) => console.warn(r.id, err)))])
    .then(() => {
      renderAll();
      setTimeout(poll, 3000);
    });
})();
