/* Benchmarks, shown the same way on an endpoint's page and on the compare page (window.TDBench):
 * a table of each level's latency and throughput (vllm bench serve's definitions), and the
 * latency/throughput curve: output tokens/s across, median TPOT and TTFT up, one line per benchmark
 * and one point per level (concurrency or request rate). On /benchmarks it also runs the compare page. */
(function () {
  "use strict";
  const { el, api, fmtAgo } = window.TD;
  const R = window.TDRuns;
  const ms = (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : v.toFixed(0));
  const num = (v, d) => (v === null || v === undefined ? "–" : v.toFixed(d));

  function levelLabel(level) {
    return level.concurrency !== null ? "c=" + level.concurrency : level.request_rate + " req/s";
  }

  function label(b) {
    return b.model + " @ " + b.pool + " · " + b.id.slice(0, 9);
  }

  /** The tail percentile a benchmark reports (the highest of its metric_percentiles; p99 by default). */
  function tail(b) {
    const ps = (b.config && b.config.metric_percentiles) || [99];
    return "p" + String(Math.max(...ps));
  }

  /** The levels of one benchmark as table rows. */
  function levelRows(b) {
    const p = tail(b);
    const pct = (stat) => ms(stat.median) + " / " + ms(stat.percentiles ? stat.percentiles[p] : null);
    return b.results.map((l) => el("tr", {},
      el("td", { className: "mono" }, levelLabel(l)),
      el("td", { className: "num" }, l.completed + (l.failed ? " (" + l.failed + " failed)" : "")),
      el("td", { className: "num" }, num(l.request_throughput, 2)),
      ...(b.config.goodput ? [el("td", { className: "num" }, num(l.request_goodput, 2))] : []),
      el("td", { className: "num" }, num(l.output_throughput, 1)),
      el("td", { className: "num" }, pct(l.ttft_ms)),
      el("td", { className: "num" }, pct(l.tpot_ms)),
      el("td", { className: "num" }, pct(l.itl_ms)),
      el("td", { className: "num" }, pct(l.e2el_ms)),
      el("td", { className: "num" }, R.fmtUSD(l.usd_per_million_output_tokens)),
    ));
  }

  function levelTable(b) {
    const p = tail(b);
    const head = ["Level", "Done", "req/s", ...(b.config.goodput ? ["goodput req/s"] : []), "out tok/s",
      "TTFT p50 / " + p + " ms", "TPOT p50 / " + p + " ms", "ITL p50 / " + p + " ms", "E2E p50 / " + p + " ms", "$ / M out tok"];
    return el("table", { className: "table compact bench-table" },
      el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { className: i ? "num" : "" }, h)))),
      el("tbody", {}, levelRows(b)));
  }

  /** A chart of latency against throughput for each benchmark (two y axes: TPOT and TTFT). */
  function curveChart(canvas) {
    if (!window.Chart) return null;
    return new window.Chart(canvas, {
      type: "line",
      data: { datasets: [] },
      options: R.lineOptions({
        interaction: { mode: "nearest", axis: "xy", intersect: false },
        scales: {
          x: { title: { display: true, text: "output tokens / s" }, ticks: { precision: undefined } },
          y: { beginAtZero: true, title: { display: true, text: "median TPOT, ms (solid)" } },
          y2: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: "median TTFT, ms (dashed)" } },
        },
        plugins: {
          legend: { display: true, position: "top", align: "end" },
          tooltip: { callbacks: {
            title: (items) => (items.length ? items[0].raw.level : ""),
            label: (item) => item.dataset.label + ": " + item.parsed.y.toFixed(1) + " ms at " + item.parsed.x.toFixed(1) + " tok/s",
          } },
        },
      }),
    });
  }

  function setCurves(chart, benchmarks) {
    if (!chart) return;
    const sets = [];
    benchmarks.forEach((b, i) => {
      const hex = R.color(i);
      const pts = (key) => b.results.filter((l) => l[key].median !== null)
        .map((l) => ({ x: l.output_throughput, y: l[key].median, level: levelLabel(l) }));
      const name = benchmarks.length > 1 ? label(b) : "";
      sets.push(R.lineDataset((name ? name + " " : "") + "TPOT", hex, { data: pts("tpot_ms"), pointRadius: 4, tension: 0, yAxisID: "y" }));
      sets.push(R.lineDataset((name ? name + " " : "") + "TTFT", hex, { data: pts("ttft_ms"), pointRadius: 3, tension: 0, borderDash: [5, 4], yAxisID: "y2" }));
    });
    chart.data.datasets = sets;
    chart.update("none");
  }

  function summary(b) {
    const c = b.config;
    const levels = c.mode === "rate" ? c.request_rates.map((r) => r + "/s").join(", ") + (c.max_concurrency ? " (≤ " + c.max_concurrency + " in flight)" : "")
      : "concurrency " + c.concurrency.join(", ");
    const prompts = c.dataset_id ? "prompts of " + c.dataset_id : c.input_len + " tokens in";
    const slo = c.goodput ? " · goodput SLO " + Object.entries(c.goodput).map(([k, v]) => k + " ≤ " + v + " ms").join(", ") : "";
    return levels + " · " + c.num_prompts + " requests each · " + prompts + " · " + c.output_len + " tokens out" + slo;
  }

  window.TDBench = { levelTable, curveChart, setCurves, summary, label, levelLabel };

  // ---------- the compare page ----------
  const page = document.getElementById("benchmarks-page");
  if (!page) return;
  const $ = (id) => document.getElementById(id);
  const chosen = new Set();
  let all = [];
  const chart = curveChart($("compare-chart"));

  function redraw() {
    const picked = all.filter((b) => chosen.has(b.id));
    setCurves(chart, picked);
    $("compare-empty").hidden = picked.length > 0;
    const tables = $("compare-tables");
    tables.replaceChildren(...picked.map((b) => el("div", { className: "section" },
      el("h3", { className: "mono small" }, label(b)), el("div", { className: "table-wrap" }, levelTable(b)))));
  }

  async function load() {
    all = (await api("/api/v1/benchmarks?limit=200")).data.filter((b) => b.status === "succeeded");
    const body = $("benchmarks-table").querySelector("tbody");
    if (!all.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 6 }, "No finished benchmarks yet: run one from an endpoint's page.")));
      return;
    }
    for (const b of all.slice(0, 2)) chosen.add(b.id);
    body.replaceChildren(...all.map((b) => {
      const box = el("input", { type: "checkbox", "aria-label": "compare " + b.id });
      box.checked = chosen.has(b.id);
      box.addEventListener("change", () => { if (box.checked) chosen.add(b.id); else chosen.delete(b.id); redraw(); });
      const best = b.results.reduce((m, l) => Math.max(m, l.output_throughput), 0);
      return el("tr", { dataset: { id: b.id } },
        el("td", {}, box),
        el("td", { className: "mono" }, b.endpoint_id ? el("a", { href: "/endpoints/" + b.endpoint_id }, b.model) : b.model),
        el("td", { className: "mono" }, b.pool + " · " + b.runtime),
        el("td", { className: "small" }, summary(b)),
        el("td", { className: "num" }, best.toFixed(1)),
        el("td", { className: "muted" }, fmtAgo(b.created_at)));
    }));
    redraw();
  }
  load();
})();
