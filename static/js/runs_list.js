/* Runs list: a status filter, row checkboxes for the compare view, and live rows (GET /api/v1/runs
 * every 2 s while any run is still in progress). */
(function () {
  "use strict";
  const { el, api, fmtDate, fmtAgo, refreshAgo } = window.TD;
  const { isTerminal, statusCell, fmtUSD } = window.TDRuns;
  const $ = (id) => document.getElementById(id);

  const body = $("runs-body");
  const filter = $("status-filter");
  const compareBtn = $("compare-btn");
  const selectAll = $("select-all");
  const live = $("live");
  const POLL_ACTIVE_MS = 2000;
  const POLL_IDLE_MS = 15000;

  const selected = new Set();
  let runs = null; // the last list from the API; null until the first answer
  let timer = null;

  // ---------- filter & selection ----------
  const params = new URLSearchParams(window.location.search);
  if (params.get("status")) filter.value = params.get("status");

  function visibleRows() {
    return [...body.querySelectorAll("tr[data-id]")].filter((tr) => !tr.hidden);
  }

  function applyFilter() {
    const want = filter.value;
    let shown = 0;
    body.querySelectorAll("tr[data-id]").forEach((tr) => {
      tr.hidden = !!want && tr.dataset.status !== want;
      if (!tr.hidden) shown++;
    });
    let note = body.querySelector("tr.filter-empty");
    const anyRows = body.querySelector("tr[data-id]") !== null;
    if (anyRows && shown === 0) {
      if (!note) {
        note = el("tr", { className: "empty filter-empty" }, el("td", { colspan: 9 }));
        body.append(note);
      }
      note.firstChild.textContent = "No runs are " + want.replace("_", " ") + ".";
    } else if (note) {
      note.remove();
    }
    syncSelection();
  }

  function syncSelection() {
    body.querySelectorAll("input.run-select").forEach((box) => {
      box.checked = selected.has(box.value);
      box.closest("tr").classList.toggle("selected", box.checked);
    });
    const n = selected.size;
    compareBtn.disabled = n < 2;
    compareBtn.textContent = n ? "Compare (" + n + ")" : "Compare";
    compareBtn.title = n < 2 ? "Select two or more runs" : "Compare the selected runs";
    const boxes = visibleRows().map((tr) => tr.querySelector("input.run-select")).filter(Boolean);
    selectAll.checked = boxes.length > 0 && boxes.every((b) => b.checked);
    selectAll.indeterminate = !selectAll.checked && boxes.some((b) => b.checked);
  }

  filter.addEventListener("change", () => {
    const url = new URL(window.location.href);
    if (filter.value) url.searchParams.set("status", filter.value); else url.searchParams.delete("status");
    window.history.replaceState(null, "", url);
    applyFilter();
  });

  body.addEventListener("change", (e) => {
    const box = e.target.closest("input.run-select");
    if (!box) return;
    if (box.checked) selected.add(box.value); else selected.delete(box.value);
    syncSelection();
  });

  selectAll.addEventListener("change", () => {
    visibleRows().forEach((tr) => {
      if (selectAll.checked) selected.add(tr.dataset.id); else selected.delete(tr.dataset.id);
    });
    syncSelection();
  });

  compareBtn.addEventListener("click", () => {
    if (selected.size < 2) return;
    // Keep the table's order (newest first) rather than the order of clicks.
    const order = [...body.querySelectorAll("tr[data-id]")].map((tr) => tr.dataset.id);
    const ids = [...selected].sort((a, b) => order.indexOf(a) - order.indexOf(b));
    window.location.assign("/runs/compare?ids=" + ids.map(encodeURIComponent).join(","));
  });

  // ---------- rows ----------
  let datasetNames = {}; // id -> filename

  function datasetLink(id) {
    const name = datasetNames[id];
    return el("a", { className: "dataset-link" + (name ? "" : " mono"), href: "/datasets/" + encodeURIComponent(id), title: id }, name || id);
  }

  async function loadDatasetNames() {
    try {
      const list = await api("/api/v1/datasets?limit=1000");
      datasetNames = Object.fromEntries(list.data.map((d) => [d.id, d.filename]));
    } catch (_) {
      datasetNames = {};
    }
  }

  function progressCell(run) {
    const done = run.status === "succeeded";
    const pct = done ? 100 : run.total_steps ? Math.min(100, Math.floor((100 * run.step) / run.total_steps)) : 0;
    const tone = done ? " done" : run.status === "failed" ? " bad" : ["cancelled", "paused"].includes(run.status) ? " stopped" : "";
    const bar = el("div", { className: "progress-bar" + tone, style: "width:" + pct + "%" });
    const track = el("div", { className: "progress" + (run.status === "running" ? " striped" : "") }, bar);
    return el("div", { className: "mini-progress" }, track,
      el("span", { className: "small muted nowrap" }, run.step + " / " + (run.total_steps || "?")));
  }

  function row(run) {
    return el("tr", { dataset: { id: run.id, status: run.status } },
      el("td", { className: "check-col" },
        el("input", { type: "checkbox", className: "run-select", value: run.id, "aria-label": "Select " + run.id })),
      el("td", {},
        el("a", { className: "mono run-link", href: "/runs/" + encodeURIComponent(run.id) }, run.id),
        run.suffix ? el("div", { className: "small muted" }, run.suffix) : null),
      el("td", {}, statusCell(run)),
      el("td", {}, el("span", { className: "tag" }, run.base_model)),
      el("td", {}, datasetLink(run.dataset_id)),
      el("td", {}, run.pool),
      el("td", {}, progressCell(run)),
      el("td", { className: "num nowrap" }, fmtUSD(run.cost_usd)),
      el("td", { className: "muted nowrap" }, el("span", { dataset: { ago: run.created_at }, title: fmtDate(run.created_at) + " UTC" }, fmtAgo(run.created_at))),
    );
  }

  function render(list) {
    runs = list.data;
    $("run-count").textContent = String(list.count);
    if (!runs.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 9 },
        "No runs yet. ", el("a", { href: "/runs/new" }, "Launch your first fine-tune"), ".")));
    } else {
      body.replaceChildren(...runs.map(row));
      refreshAgo(body);
    }
    // Forget selections of runs that are gone.
    const ids = new Set(runs.map((r) => r.id));
    for (const id of [...selected]) if (!ids.has(id)) selected.delete(id);
    applyFilter();
  }

  function anyActive() {
    if (runs) return runs.some((r) => !isTerminal(r.status));
    return [...body.querySelectorAll("tr[data-status]")].some((tr) => !isTerminal(tr.dataset.status));
  }

  function schedule() {
    clearTimeout(timer);
    const active = anyActive();
    live.classList.toggle("on", active);
    live.textContent = active ? "Live" : "Up to date";
    timer = setTimeout(refresh, active ? POLL_ACTIVE_MS : POLL_IDLE_MS);
  }

  async function refresh() {
    try {
      render(await api("/api/v1/runs?limit=200"));
    } catch (err) {
      live.classList.remove("on");
      live.textContent = err.status === 401 ? "Signed out" : "Reconnecting…";
      if (err.status === 401) return;
    }
    schedule();
  }

  applyFilter();
  loadDatasetNames().then(refresh);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
})();
