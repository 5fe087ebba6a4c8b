/* One dataset's validation report. Everything is drawn by render(dataset): first from the JSON the
 * server embedded in the page, then again on every server-sent event. */
(function () {
  "use strict";
  const { el, watch, statusPill, fmtNum, fmtBytes, fmtMB, fmtDate } = window.TD;
  const $ = (id) => document.getElementById(id);

  const initial = JSON.parse($("dataset-data").textContent);
  const datasetId = initial.id;

  const set = (id, value) => { $(id).textContent = value; };
  const dash = (n) => (n === null || n === undefined ? "–" : fmtNum(n));

  function renderHeader(d) {
    $("dataset-filename").textContent = d.filename;
    statusPill(d.status, $("dataset-status"));
    document.title = d.filename + " · Tunedeck";
    const item = (label, value, mono) =>
      el("span", {}, label + " ", mono ? el("code", {}, value) : el("b", {}, value));
    $("dataset-meta").replaceChildren(
      item("ID", d.id, true),
      item("Format", d.format || "detecting…"),
      item("File type", d.file_type || "detecting…"),
      item("Size", fmtBytes(d.bytes)),
      item("Uploaded", fmtDate(d.created_at) + " UTC"),
    );
  }

  function renderProgress(d) {
    const box = $("validation-progress");
    box.hidden = d.status !== "validating";
    if (box.hidden) return;
    const pct = d.bytes ? Math.min(100, Math.floor((100 * d.progress_bytes) / d.bytes)) : 0;
    $("validation-bar").style.width = pct + "%";
    set("validation-percent", pct + "%");
    set("validation-bytes", fmtMB(d.progress_bytes) + " / " + fmtMB(d.bytes));
  }

  function renderKpis(d) {
    const done = d.status !== "validating";
    set("stat-rows", dash(d.rows));
    set("stat-valid", dash(d.valid_rows));
    set("stat-valid-note", d.rows ? ((100 * (d.valid_rows || 0)) / d.rows).toFixed(1) + "% of rows" : "\u00a0");
    set("stat-errors", done ? fmtNum(d.error_count) : "–");
    set("stat-duplicates", done ? fmtNum(d.duplicate_count) : "–");
    $("kpi-errors").classList.toggle("bad", d.error_count > 0);
    $("kpi-dups").classList.toggle("warn", d.duplicate_count > 0);
    const stats = d.stats || {};
    set("stat-tokens", stats.tokens_total === undefined ? "–" : fmtNum(stats.tokens_total));
    set("stat-tokens-note", stats.token_estimate ? "estimated as " + stats.token_estimate : "total, estimated");
  }

  // ---------- histogram ----------
  function binLabel(edges, i) {
    const a = Math.round(edges[i]);
    const b = Math.round(edges[i + 1]);
    return a === b ? String(a) : fmtNum(a) + "–" + fmtNum(b);
  }

  function renderHistogram(d) {
    const hist = d.stats && d.stats.histogram;
    const canvas = $("length-histogram");
    const existing = window.Chart ? window.Chart.getChart(canvas) : null;
    const empty = !hist || !hist.counts || !hist.counts.length;
    $("histogram-empty").hidden = !empty;
    canvas.parentElement.hidden = empty;
    if (empty) {
      $("histogram-empty").textContent = d.status === "validating" ? "Computing lengths…" : "No length statistics for this dataset.";
      if (existing) existing.destroy();
      return;
    }
    if (!window.Chart) return;
    const unit = hist.unit || "tokens";
    set("histogram-unit", unit + " per record");
    const labels = hist.counts.map((_, i) => binLabel(hist.edges, i));
    if (existing) {
      existing.data.labels = labels;
      existing.data.datasets[0].data = hist.counts.slice();
      existing.update();
      return;
    }
    new window.Chart(canvas, {
      type: "bar",
      data: {
        labels,
        datasets: [{
          label: "Records",
          data: hist.counts.slice(),
          backgroundColor: "rgba(79, 70, 229, 0.75)",
          hoverBackgroundColor: "rgba(67, 56, 202, 0.95)",
          borderRadius: 3,
          categoryPercentage: 0.92,
          barPercentage: 0.95,
        }],
      },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        plugins: {
          legend: { display: false },
          tooltip: { callbacks: { title: (items) => items[0].label + " " + unit } },
        },
        scales: {
          x: { grid: { display: false }, ticks: { color: "#64708a", font: { size: 11 }, maxRotation: 0, autoSkip: true }, title: { display: true, text: unit, color: "#64708a" } },
          y: { beginAtZero: true, ticks: { precision: 0, color: "#64708a", font: { size: 11 } }, grid: { color: "#eef1f5" }, title: { display: true, text: "records", color: "#64708a" } },
        },
      },
    });
  }

  function renderLengthStats(d) {
    const stats = d.stats || {};
    const tbody = $("length-stats").tBodies[0];
    const chars = stats.chars || {};
    const tokens = stats.tokens || {};
    const fmt = (v) => (v === undefined || v === null ? "–" : fmtNum(v, 1));
    tbody.replaceChildren(...["min", "median", "p95", "max", "mean"].map((key) =>
      el("tr", {},
        el("td", { className: "muted" }, key),
        el("td", { className: "num" }, fmt(chars[key])),
        el("td", { className: "num" }, fmt(tokens[key])))));
    const roles = stats.roles || {};
    const names = Object.keys(roles);
    $("roles").replaceChildren(names.length
      ? el("span", {}, "Turns by role: ", ...names.flatMap((r, i) => [i ? " · " : "", el("b", {}, r), " " + fmtNum(roles[r])]))
      : el("span", {}, d.status === "validating" ? "Statistics appear when validation finishes." : "No per-role statistics."));
  }

  // ---------- problems ----------
  function renderErrors(d) {
    const errors = d.errors || [];
    $("errors-card").hidden = errors.length === 0;
    const tbody = $("errors-table").tBodies[0];
    const rows = errors.map((e) => {
      const hasLine = e.line !== null && e.line !== undefined;
      return el("tr", { dataset: hasLine ? { line: String(e.line) } : {} },
        el("td", { className: "err-line" }, hasLine ? String(e.line) : "file"),
        el("td", { className: "err-field" }, e.field || "–"),
        el("td", { className: "err-problem" }, e.message));
    });
    const more = d.error_count - errors.length;
    if (more > 0) rows.push(el("tr", { className: "more-row" }, el("td", { colspan: 3 }, "…and " + fmtNum(more) + " more")));
    tbody.replaceChildren(...rows);
    set("errors-summary", d.error_count === 1 ? "1 problem" : fmtNum(d.error_count) + " problems");
  }

  function renderDuplicates(d) {
    const dups = d.duplicates || [];
    set("duplicates-summary", d.status === "validating" ? "" : fmtNum(d.duplicate_count) + " found");
    const list = $("duplicates");
    if (!dups.length) {
      list.replaceChildren(el("li", { className: "muted" },
        d.status === "validating" ? "Checking…" : "No duplicate records."));
      return;
    }
    const items = dups.map((x) => el("li", { dataset: { line: String(x.line) } },
      "Line ", el("b", {}, String(x.line)), " repeats line ", el("b", {}, String(x.duplicate_of))));
    const more = d.duplicate_count - dups.length;
    if (more > 0) items.push(el("li", { className: "muted" }, "…and " + fmtNum(more) + " more"));
    list.replaceChildren(...items);
  }

  function renderDetails(d) {
    const row = (k, v) => [el("dt", {}, k), el("dd", {}, v)];
    $("details").replaceChildren(
      ...row("Purpose", d.purpose),
      ...row("Format", d.format || "–"),
      ...row("File type", d.file_type || "–"),
      ...row("Size", fmtBytes(d.bytes) + " (" + fmtNum(d.bytes) + " bytes)"),
      ...row("SHA-256", el("code", { title: d.sha256 }, d.sha256)),
      ...row("Uploaded", fmtDate(d.created_at) + " UTC"),
      ...row("Validated", d.validated_at ? fmtDate(d.validated_at) + " UTC" : "–"),
    );
  }

  // ---------- preview ----------
  const KNOWN_ROLES = ["system", "user", "assistant", "text"];

  function renderPreview(d) {
    const records = d.preview || [];
    const box = $("preview");
    set("preview-summary", records.length ? "first " + records.length + " records" : "");
    if (!records.length) {
      box.replaceChildren(el("div", { className: "placeholder" },
        d.status === "validating" ? "The preview appears when validation finishes." : "Nothing to preview."));
      return;
    }
    box.replaceChildren(...records.map((rec) => {
      if (rec.error !== undefined && !rec.messages) {
        return el("div", { className: "convo bad" },
          el("div", { className: "convo-head" }, el("span", {}, "Line " + rec.line), el("span", {}, "not usable")),
          el("div", { className: "convo-error" }, rec.error));
      }
      const turns = (rec.messages || []).map((m) => {
        const role = KNOWN_ROLES.includes(m.role) ? m.role : "other";
        return el("div", { className: "turn " + role },
          role === "text" ? null : el("span", { className: "role" }, m.role),
          el("div", { className: "bubble" }, typeof m.content === "string" ? m.content : JSON.stringify(m.content)));
      });
      return el("div", { className: "convo", dataset: { line: String(rec.line) } },
        el("div", { className: "convo-head" }, el("span", {}, "Line " + rec.line),
          el("span", {}, turns.length + (turns.length === 1 ? " turn" : " turns"))),
        el("div", { className: "turns" }, turns));
    }));
  }

  function render(d) {
    renderHeader(d);
    renderProgress(d);
    renderKpis(d);
    renderHistogram(d);
    renderLengthStats(d);
    renderErrors(d);
    renderDuplicates(d);
    renderDetails(d);
    renderPreview(d);
  }

  window.renderDataset = render;
  render(initial);

  watch("/api/v1/datasets/" + encodeURIComponent(datasetId) + "?watch=true", {
    update: (d) => render(d),
    deleted: (_, source) => {
      source.close();
      $("deleted-banner").hidden = false;
      statusPill("deleted", $("dataset-status"));
      $("delete-dataset").disabled = true;
      $("live").classList.remove("on");
      $("live").textContent = "Deleted";
    },
  }, $("live"));
})();
