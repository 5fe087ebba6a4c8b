/* Evaluations: the list (/evaluations), and one evaluation live over /api/v1/evaluations/{id}?watch=true
 * (/evaluations/{id}): the replies' progress, each subject's mean score per metric with its 95% bootstrap
 * interval (a table, and a chart of one metric), and the scored samples, in eval-set order or where the
 * subjects differ most first. */
(function () {
  "use strict";
  const { el, api, watch, statusPill, fmtAgo } = window.TD;
  const $ = (id) => document.getElementById(id);
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1));

  function subjectsText(e) {
    return e.subjects.map((s) => s.label).join(" · ");
  }

  // ---------- the list ----------
  if ($("evaluations-page")) {
    (async () => {
      const body = $("evaluations-table").tBodies[0];
      const list = (await api("/api/v1/evaluations?limit=200")).data;
      if (!list.length) {
        body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 6 }, "No evaluations yet: evaluate a run's checkpoints from the API (POST /api/v1/evaluations).")));
        return;
      }
      body.replaceChildren(...list.map((e) => el("tr", {},
        el("td", {}, el("a", { className: "mono", href: "/evaluations/" + encodeURIComponent(e.id) }, e.id)),
        el("td", {}, subjectsText(e)),
        el("td", { className: "small" }, e.config.metrics.join(", ")),
        el("td", {}, statusPill(e.status)),
        el("td", { className: "num" }, e.samples_done + " / " + e.samples_total),
        el("td", { className: "small muted" }, fmtAgo(e.created_at)))));
    })();
    return;
  }

  // ---------- one evaluation ----------
  if (!$("evaluation-page")) return;
  const initial = JSON.parse($("evaluation-data").textContent);
  const base = "/api/v1/evaluations/" + encodeURIComponent(initial.id);
  const R = window.TDRuns;
  const judged = Boolean(initial.config.judge);
  // The judge's grade is a metric like the others (on the same 0-1 scale), when there is a judge.
  const metrics = initial.config.metrics.concat(judged ? ["judge"] : []);
  const labels = Object.fromEntries(initial.subjects.map((s) => [s.key, s.label]));
  let chart = null;
  let current = initial;
  let samplesShown = 0;
  let scoredLoaded = false;

  function renderProgress(e) {
    const pill = $("evaluation-status");
    pill.className = "pill pill-lg pill-run-" + e.status;
    pill.textContent = e.status;
    const share = e.samples_total ? e.samples_done / e.samples_total : 0;
    $("progress-bar").style.width = (100 * share).toFixed(1) + "%";
    $("progress-bar").className = "progress-bar" + (e.status === "succeeded" ? " done" : e.status === "failed" ? " bad" : "");
    $("progress-percent").textContent = (100 * share).toFixed(0) + "%";
    $("progress-count").textContent = e.samples_done + " of " + e.samples_total + " replies";
    $("progress-phase").textContent = e.phase || (e.status === "queued" ? "waiting for a worker of pool " + e.pool : e.status);
    $("evaluation-error").textContent = e.error || "";
    $("evaluation-error").hidden = !e.error;
    $("evaluation-cost").textContent = (e.chip_seconds / 3600).toFixed(3) + " chip-hours" + (e.cost_usd ? " · " + R.fmtUSD(e.cost_usd) : "");
    $("cancel-button").hidden = !(e.status === "queued" || e.status === "running") || e.cancel_requested;
  }

  function renderSummary(e) {
    const keys = initial.subjects.map((s) => s.key).filter((k) => e.summary[k]);
    if (!keys.length) return;
    const table = $("summary-table");
    table.tHead.replaceChildren(el("tr", {}, el("th", {}, "Subject"), metrics.map((m) => el("th", { className: "num" }, m))));
    table.tBodies[0].replaceChildren(...keys.map((k) => el("tr", { dataset: { subject: k } },
      el("td", {}, labels[k]),
      metrics.map((m) => {
        const s = e.summary[k][m];
        const shown = s && s.n ? R.evalText(m, s.mean) + " [" + R.evalText(m, s.low) + "–" + R.evalText(m, s.high) + "]" : "–";
        const bad = s && s.unparsable ? el("span", { className: "faint", title: "verdicts the judge did not give as asked" }, " · " + s.unparsable + " unparsable") : null;
        return el("td", { className: "num", title: s ? "n = " + s.n : "" }, shown, bad);
      }))));
    renderPairwise(e);
    drawChart(e, keys);
  }

  function renderPairwise(e) {
    const pairs = Object.entries(e.summary.pairwise || {});
    $("pairwise-card").hidden = !pairs.length;
    if (!pairs.length) return;
    const rate = (p, what) => pct(p[what + "_rate"]) + (p[what + "_rate_ci"] ? " [" + pct(p[what + "_rate_ci"][0]) + "–" + pct(p[what + "_rate_ci"][1]) + "]" : "");
    $("pairwise-table").tBodies[0].replaceChildren(...pairs.map(([pair, p]) => {
      const [a, b] = pair.split(":");
      return el("tr", { dataset: { pair } },
        el("td", {}, labels[a] + " vs " + labels[b]),
        el("td", { className: "num" }, p.n ? rate(p, "win") : "–"),
        el("td", { className: "num" }, p.n ? pct(p.tie_rate) : "–"),
        el("td", { className: "num" }, p.n ? rate(p, "loss") : "–"),
        el("td", { className: "num" }, String(p.unparsable)));
    }));
  }

  function drawChart(e, keys) {
    const select = $("chart-metric");
    if (!select.options.length) {
      select.replaceChildren(...metrics.map((m) => el("option", { value: m }, m)));
      // Shown first: the metric on which the subjects differ most (perplexity, not a share, only alone).
      const gap = (m) => { if (R.evalScale(m) !== 100) return -1; const v = keys.map((k) => (e.summary[k][m] || {}).mean || 0); return Math.max(...v) - Math.min(...v); };
      select.value = metrics.reduce((best, m) => (gap(m) > gap(best) ? m : best), metrics[0]);
      select.addEventListener("change", () => drawChart(current, keys));
    }
    if (!window.Chart) return;
    const m = select.value;
    const k = R.evalScale(m);
    const data = {
      labels: keys.map((key) => labels[key]),
      datasets: [
        { label: "95% interval", data: keys.map((key) => (e.summary[key][m] || {}).n ? [k * e.summary[key][m].low, k * e.summary[key][m].high] : null), backgroundColor: R.alpha(R.color(1), 0.35), barPercentage: 0.5 },
        { label: "mean", data: keys.map((key) => (e.summary[key][m] || {}).n ? k * e.summary[key][m].mean : null), backgroundColor: R.color(0), barPercentage: 0.15 },
      ],
    };
    const y = { beginAtZero: true, max: k === 100 ? 100 : undefined, title: { display: true, text: R.evalAxis(m) } };
    if (!chart) {
      chart = new window.Chart($("summary-chart"), {
        type: "bar",
        data,
        options: { animation: false, responsive: true, maintainAspectRatio: false,
          scales: { x: { stacked: true }, y },
          plugins: { legend: { display: true, position: "top", align: "end" } } },
      });
    } else {
      chart.data = data;
      chart.options.scales.y = y;
      chart.update("none");
    }
  }

  // ---------- promote: a checkpoint subject deployed, new or into a ready endpoint's place ----------
  const checkpoints = initial.subjects.filter((s) => s.kind === "checkpoint");
  let promoteShown = false;

  async function renderPromote(e) {
    if (e.status !== "succeeded" || !checkpoints.length || promoteShown) return;
    promoteShown = true;
    // The best checkpoint by the charted metric comes first, marked.
    const m = $("chart-metric").value || metrics[0];
    const score = (s) => ((e.summary[s.key] || {})[m] || {}).mean;
    const scored = checkpoints.filter((s) => score(s) !== undefined);
    const ranked = scored.sort((a, b) => (R.evalBetter(m, score(a), score(b)) ? -1 : R.evalBetter(m, score(b), score(a)) ? 1 : 0))
      .concat(checkpoints.filter((s) => score(s) === undefined));
    $("promote-subject").replaceChildren(...ranked.map((s, i) => el("option", { value: s.key },
      s.label + " · " + m + " " + R.evalText(m, score(s)) + (i === 0 && ranked.length > 1 ? " (best)" : ""))));
    const ready = (await api("/api/v1/endpoints?limit=1000")).data.filter((x) => x.status === "ready");
    $("promote-target").replaceChildren(el("option", { value: "" }, "a new endpoint"),
      ...ready.map((x) => el("option", { value: x.id }, "the place of " + x.id + " (" + x.model + ")")));
    $("promote-card").hidden = false;
  }

  $("promote-button").addEventListener("click", async () => {
    const button = $("promote-button");
    button.disabled = true;
    $("promote-error").hidden = true;
    try {
      const target = $("promote-target").value;
      const body = { subject: $("promote-subject").value };
      if (target) body.endpoint_id = target;
      const made = await api(base + "/promote", { method: "POST", json: body });
      $("promote-done").replaceChildren("Deploying as ", el("a", { className: "mono", id: "promoted-endpoint", href: "/endpoints/" + encodeURIComponent(made.id) }, made.id),
        target ? " under the name " + made.model + ": " + target + " stops once it is ready." : ".");
      $("promote-done").hidden = false;
    } catch (err) {
      $("promote-error").textContent = err.message;
      $("promote-error").hidden = false;
    } finally {
      button.disabled = false;
    }
  });

  function verdict(j) {
    if (!j) return null;
    if ("unparsable" in j) return el("div", { className: "small faint", title: j.unparsable }, "judge: unparsable");
    return el("div", { className: "small" }, "judge " + j.score + "/10: " + j.reason);
  }

  async function loadSamples(reset) {
    if (reset) samplesShown = 0;
    const order = $("samples-order").value;
    const page = await api(base + "/samples?limit=50&offset=" + samplesShown + "&order=" + order);
    const keys = initial.subjects.map((s) => s.key);
    const table = $("samples-table");
    table.tHead.replaceChildren(el("tr", {}, el("th", { className: "num" }, "#"), el("th", {}, "Prompt"), el("th", {}, "Reference"),
      keys.map((k) => el("th", {}, labels[k])), el("th", { className: "num" }, "spread")));
    const rows = page.data.map((s) => el("tr", {},
      el("td", { className: "num" }, s.position),
      el("td", { className: "small" }, s.messages.filter((msg) => msg.role === "user").slice(-1).map((msg) => msg.content)),
      el("td", { className: "small" }, s.reference),
      keys.map((k) => el("td", { className: "small", title: Object.entries(s.scores[k]).map(([m, v]) => m + " " + R.evalText(m, v)).join(", ") },
        el("div", {}, s.outputs[k]),
        el("div", { className: "faint mono" }, metrics.filter((m) => m in s.scores[k]).map((m) => m + " " + R.evalText(m, s.scores[k][m])).join(" · ")),
        verdict(s.judgements[k]))),
      el("td", { className: "num" }, pct(s.spread))));
    if (reset) table.tBodies[0].replaceChildren(...rows);
    else table.tBodies[0].append(...rows);
    samplesShown += page.data.length;
    $("samples-more").hidden = samplesShown >= page.count;
  }

  $("samples-order").addEventListener("change", () => loadSamples(true));
  $("samples-more").addEventListener("click", () => loadSamples(false));
  $("cancel-button").addEventListener("click", async () => {
    try {
      renderProgress(await api(base + "/cancel", { method: "POST" }));
    } catch (err) {
      $("evaluation-error").textContent = err.message;
      $("evaluation-error").hidden = false;
    }
  });

  function render(e) {
    current = e;
    renderProgress(e);
    renderSummary(e);
    if (e.status === "succeeded" && !scoredLoaded) {
      scoredLoaded = true;
      loadSamples(true);
    }
    renderPromote(e);
  }

  document.addEventListener("DOMContentLoaded", () => {
    render(initial);
    watch(base + "?watch=true", { update: render, snapshot: render }, $("live"));
  });
})();
