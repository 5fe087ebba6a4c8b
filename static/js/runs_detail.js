/* One run, live. The server embeds the run as JSON; then /api/v1/runs/{id}?watch=true sends `update`
 * events {run, metrics} whose metrics are only the points newer than the previous event (the first
 * carries everything so far). Charts append them; checkpoints and events are re-read at most every 2 s. */
(function () {
  "use strict";
  const { el, api, watch, fmtNum, fmtDate, parseDate } = window.TD;
  const R = window.TDRuns;
  const $ = (id) => document.getElementById(id);

  let run = JSON.parse($("run-data").textContent);
  const runId = run.id;
  const base = "/api/v1/runs/" + encodeURIComponent(runId);

  // ---------- metric series (arrays shared with the charts) ----------
  const series = { loss: [], eval_loss: [], learning_rate: [], tokens_per_s: [] };
  const latest = {}; // the newest value seen of every metric key, with its step
  const stepTimes = []; // recent step_time_s values, for the ETA fallback
  const samples = []; // {t, step} as seen by this page, for the ETA

  function addMetrics(rows) {
    if (!rows.length) return;
    for (const key of Object.keys(series)) R.appendPoints(series[key], R.pointsOf(rows, key), key === "eval_loss");
    for (const r of rows) {
      for (const [k, v] of Object.entries(r)) {
        if (k === "step" || typeof v !== "number" || !Number.isFinite(v)) continue;
        latest[k] = { step: r.step, value: v };
      }
      if (typeof r.step_time_s === "number") {
        stepTimes.push(r.step_time_s);
        if (stepTimes.length > 20) stepTimes.shift();
      }
    }
  }

  // ---------- charts ----------
  const charts = {};

  function makeCharts() {
    if (!window.Chart) return;
    charts.loss = new window.Chart($("loss-chart"), {
      type: "line",
      data: {
        datasets: [
          R.lineDataset("Train loss", "#4f46e5", { data: series.loss }),
          R.lineDataset("Eval loss", "#d97706", {
            data: series.eval_loss, pointRadius: 3.5, pointHoverRadius: 5, borderDash: [5, 4], borderWidth: 1.8,
            pointBackgroundColor: "#fff", tension: 0,
          }),
        ],
      },
      options: R.lineOptions({ plugins: { legend: { display: true, position: "top", align: "end" } } }),
    });
    charts.lr = new window.Chart($("lr-chart"), {
      type: "line",
      data: { datasets: [R.lineDataset("Learning rate", "#0891b2", { data: series.learning_rate, fill: true })] },
      options: R.lineOptions({
        scales: { y: { beginAtZero: true, ticks: { callback: (v) => R.fmtMetric(v, 6) } } },
        plugins: { tooltip: { callbacks: { label: (item) => "learning rate " + R.fmtMetric(item.parsed.y, 8) } } },
      }),
    });
    charts.tps = new window.Chart($("tps-chart"), {
      type: "line",
      data: { datasets: [R.lineDataset("Tokens / s", "#16a34a", { data: series.tokens_per_s, fill: true })] },
      options: R.lineOptions({ scales: { y: { beginAtZero: true } } }),
    });
  }

  function renderCharts() {
    for (const c of Object.values(charts)) c.update("none");
    $("loss-empty").hidden = series.loss.length > 0 || series.eval_loss.length > 0;
    $("lr-empty").hidden = series.learning_rate.length > 0;
    $("tps-empty").hidden = series.tokens_per_s.length > 0;
    if (!$("loss-empty").hidden) {
      $("loss-empty").textContent = R.isTerminal(run.status)
        ? "This run recorded no metrics."
        : "No metrics yet: the first points appear once training starts.";
    }
    const first = series.loss[0];
    const last = series.loss[series.loss.length - 1];
    $("loss-summary").textContent = first && last && last !== first
      ? R.fmtMetric(first.y) + " → " + R.fmtMetric(last.y) + " (" + (((last.y - first.y) / first.y) * 100).toFixed(0) + "%)"
      : "";
    const lr = latest.learning_rate;
    $("lr-summary").textContent = lr ? "now " + R.fmtMetric(lr.value, 8) : (run.config.lr_schedule || "");
  }

  // ---------- header, progress, cards ----------
  const datasetNames = {}; // id -> filename, once read

  async function loadDatasetNames() {
    const ids = [run.dataset_id, run.validation_dataset_id].filter(Boolean);
    await Promise.all(ids.map(async (id) => {
      try {
        datasetNames[id] = (await api("/api/v1/datasets/" + encodeURIComponent(id))).filename;
      } catch (_) { /* deleted or not ours: keep the id */ }
    }));
    renderHeader();
  }

  function link(href, text, mono) {
    return el("a", { href, className: mono ? "mono" : null }, text);
  }

  function renderHeader() {
    R.runPill(run.status, $("run-status"));
    const phase = !R.isTerminal(run.status) && run.phase;
    $("run-phase").hidden = !phase;
    $("run-phase").textContent = phase || "";
    document.title = "Run " + run.id + " · " + run.status + " · Tunedeck";
    const item = (label, value) => el("span", {}, label + " ", typeof value === "string" ? el("b", {}, value) : value);
    const dataset = (id) => {
      const a = link("/datasets/" + encodeURIComponent(id), datasetNames[id] || id, !datasetNames[id]);
      a.title = id;
      return a;
    };
    $("run-meta").replaceChildren(...[
      item("Base model", el("span", { className: "tag" }, run.base_model)),
      item("Dataset", dataset(run.dataset_id)),
      run.validation_dataset_id ? item("Validation", dataset(run.validation_dataset_id)) : null,
      item("Pool", link("/pools", run.pool)),
      run.suffix ? item("Suffix", run.suffix) : null,
      run.worker ? item("Worker", el("code", {}, run.worker)) : null,
      run.attempts > 1 ? item("Attempts", String(run.attempts)) : null,
      item("Created", fmtDate(run.created_at) + " UTC"),
    ].filter(Boolean));

    renderSlice();
    const failed = run.status === "failed";
    $("run-error").hidden = !failed;
    $("run-error-text").textContent = failed ? run.error || "No error message was recorded." : "";
    $("run-model").hidden = !run.fine_tuned_model;
    $("fine-tuned-model").textContent = run.fine_tuned_model || "";
  }

  /** A run on a multi-host slice: each host's process, its step time beside the others' (a straggler,
   * over 1.25x the fastest, is marked: every step waits for it). */
  function renderSlice() {
    $("run-slice").hidden = !run.slice;
    if (!run.slice) return;
    $("run-slice-name").textContent = run.slice;
    const times = run.processes.map((p) => p.step_time_s).filter((t) => t != null);
    const fastest = times.length ? Math.min(...times) : null;
    $("run-processes").tBodies[0].replaceChildren(...run.processes.map((p) => {
      const slow = fastest != null && p.step_time_s != null && p.step_time_s > 1.25 * fastest;
      return el("tr", { className: slow ? "straggler" : null, dataset: { host: String(p.host_index) } },
        el("td", {}, String(p.host_index) + (p.host_index === 0 ? " (coordinator)" : "")),
        el("td", {}, el("code", {}, p.worker)),
        el("td", {}, p.attempt === run.attempts ? p.state : "attempt " + p.attempt + ": " + p.state),
        el("td", { className: "num" }, String(p.step)),
        el("td", { className: "num" }, p.step_time_s == null ? "—"
          : fmtNum(p.step_time_s * 1000, 0) + " ms" + (slow ? " (straggler)" : "")),
        el("td", { dataset: { ago: p.heartbeat_at } }, window.TD.fmtAgo(p.heartbeat_at)));
    }));
  }

  function duration() {
    return R.elapsed(run.started_at, run.finished_at);
  }

  function eta() {
    if (run.status !== "running" || !run.total_steps) return null;
    const remaining = run.total_steps - run.step;
    if (remaining <= 0) return 0;
    const now = Date.now();
    const recent = samples.filter((s) => now - s.t < 60000);
    if (recent.length >= 2) {
      const a = recent[0];
      const b = recent[recent.length - 1];
      if (b.step > a.step && b.t - a.t >= 1500) return (remaining * (b.t - a.t)) / 1000 / (b.step - a.step);
    }
    if (stepTimes.length) return remaining * (stepTimes.reduce((x, y) => x + y, 0) / stepTimes.length);
    return null;
  }

  function renderProgress() {
    const total = run.total_steps;
    const done = run.status === "succeeded";
    const pct = done ? 100 : total ? Math.min(100, (100 * run.step) / total) : 0;
    $("run-progress-bar").style.width = pct + "%";
    $("run-progress-bar").classList.toggle("done", done);
    $("run-progress-bar").classList.toggle("bad", run.status === "failed");
    $("run-progress-bar").classList.toggle("stopped", run.status === "cancelled" || run.status === "paused");
    $("run-progress").classList.toggle("striped", run.status === "running");
    $("run-progress").setAttribute("aria-valuenow", String(Math.floor(pct)));
    $("progress-percent").textContent = total ? Math.floor(pct) + "%" : "";
    const labels = {
      validating_files: "Waiting for the dataset to finish validating",
      queued: "Queued on pool " + run.pool,
      running: run.phase ? "Running · " + run.phase : "Running",
      paused: "Paused at step " + run.step,
      succeeded: "Finished",
      failed: "Failed at step " + run.step,
      cancelled: "Cancelled at step " + run.step,
    };
    $("progress-label").textContent = labels[run.status] || run.status;
    $("progress-steps").textContent = "Step " + fmtNum(run.step) + " / " + (total ? fmtNum(total) : "?");
    renderClock();
  }

  /** The parts that move with the wall clock: elapsed time and ETA. */
  function renderClock() {
    const d = duration();
    const e = eta();
    const parts = [];
    if (d !== null) parts.push((R.isTerminal(run.status) ? "Took " : "Elapsed ") + R.fmtDuration(d));
    if (e !== null) parts.push("about " + R.fmtDuration(e) + " left");
    $("progress-time").textContent = parts.join(" · ");
    if (run.status === "running") {
      $("stat-eta").textContent = e === null ? "–" : e === 0 ? "now" : R.fmtDuration(e);
      $("stat-eta-note").textContent = e === null ? "measuring…" : "at the recent rate";
    } else {
      $("stat-eta").textContent = run.status === "succeeded" ? "done" : "–";
      $("stat-eta-note").textContent = run.status === "succeeded" && d !== null ? "took " + R.fmtDuration(d) : run.status;
    }
  }

  function renderCards() {
    $("stat-step").textContent = fmtNum(run.step);
    $("stat-step-note").textContent = run.total_steps ? "of " + fmtNum(run.total_steps) : "total not known yet";
    const loss = latest.loss;
    const ev = latest.eval_loss;
    $("stat-loss").textContent = loss ? R.fmtMetric(loss.value) : "–";
    $("stat-loss").title = loss ? "train loss at step " + loss.step : "";
    $("stat-loss-note").title = ev ? "eval loss at step " + ev.step : "";
    const first = series.loss[0];
    $("stat-loss-note").textContent = ev
      ? "eval " + R.fmtMetric(ev.value)
      : first ? "started at " + R.fmtMetric(first.y) : "\u00a0";
    const tps = latest.tokens_per_s;
    $("stat-tps").textContent = tps ? fmtNum(tps.value, tps.value >= 100 ? 0 : 1) : "–";
    const perChip = latest.tokens_per_s_per_chip;
    const mfu = latest.mfu;
    const tpsNotes = [];
    if (perChip && perChip.value !== (tps && tps.value)) tpsNotes.push(fmtNum(perChip.value, 0) + " per chip");
    if (mfu) tpsNotes.push("MFU " + (100 * mfu.value).toFixed(1) + "%");
    $("stat-tps-note").textContent = tpsNotes.length ? tpsNotes.join(" · ") : "latest step";
    $("stat-tps-note").title = mfu ? "model FLOPs utilisation against the chip's bf16 peak" : "";
    const st = latest.step_time_s;
    $("stat-step-time").textContent = st ? R.fmtDuration(st.value) : "–";
    const mem = latest.memory_gb || latest.host_rss_gb;
    $("stat-step-time-note").textContent = mem
      ? (latest.memory_gb ? "device memory " : "host memory ") + mem.value.toFixed(2) + " GB peak"
      : "latest step";
    $("stat-cost").textContent = R.fmtUSD(run.cost_usd);
    $("stat-cost-note").textContent = "on pool " + run.pool;
    refreshCost();
  }

  // The run's total: training plus the endpoints serving its artifacts (re-read at most every 10 s).
  let costReadAt = 0;
  async function refreshCost() {
    if (Date.now() - costReadAt < 10_000) return;
    costReadAt = Date.now();
    try {
      const cost = await api(base + "/cost");
      if (!cost.endpoints.length) return;
      $("stat-cost").textContent = R.fmtUSD(cost.total_usd);
      $("stat-cost-note").textContent = R.fmtUSD(cost.training_usd) + " training on " + run.pool + " + " +
        R.fmtUSD(cost.serving_usd) + " serving (" + cost.endpoints.length + " endpoint" + (cost.endpoints.length > 1 ? "s" : "") + ")";
    } catch (_) { /* the next update tries again */ }
  }

  function renderConfig() {
    const cfg = run.config || {};
    $("run-config").replaceChildren(...R.configKeys(cfg).flatMap((k) => [
      el("dt", {}, k), el("dd", { className: "mono" }, R.fmtValue(cfg[k])),
    ]));
  }

  // ---------- actions ----------
  let pending = null; // "pause" | "cancel" requested while the run is still running

  function renderActions() {
    const s = run.status;
    if (pending && s !== "running") pending = null;
    $("cancel-run").hidden = !R.ACTIVE.includes(s);
    $("pause-run").hidden = s !== "running";
    $("resume-run").hidden = s !== "paused";
    $("delete-run").hidden = !R.isTerminal(s);
    $("cancel-run").disabled = pending === "cancel";
    $("pause-run").disabled = pending !== null;
    $("cancel-run").textContent = pending === "cancel" ? "Cancelling…" : "Cancel";
    $("pause-run").textContent = pending === "pause" ? "Pausing…" : "Pause";
    $("action-note").textContent = pending === "pause"
      ? "Pause requested: saving a checkpoint first"
      : pending === "cancel" ? "Cancellation requested" : "";
  }

  async function act(action, button) {
    if (action === "cancel" && !window.confirm("Cancel this run? Its checkpoints are kept, but it cannot be resumed.")) return;
    $("action-error").hidden = true;
    button.disabled = true;
    try {
      const updated = await api(base + "/" + action, { method: "POST" });
      pending = updated.status === "running" && action !== "resume" ? action : null;
      update({ run: updated });
    } catch (err) {
      $("action-error").textContent = "Could not " + action + " the run: " + err.message;
      $("action-error").hidden = false;
    }
    renderActions();
  }

  async function deleteRun(button) {
    if (!window.confirm("Delete this run? Its checkpoints, logs, metrics and events are removed for good.")) return;
    $("action-error").hidden = true;
    button.disabled = true;
    try {
      await api(base, { method: "DELETE" });
      window.location.assign("/runs");
    } catch (err) {
      $("action-error").textContent = "Could not delete the run: " + err.message;
      $("action-error").hidden = false;
      button.disabled = false;
    }
  }

  $("cancel-run").addEventListener("click", (e) => act("cancel", e.currentTarget));
  $("delete-run").addEventListener("click", (e) => deleteRun(e.currentTarget));
  $("pause-run").addEventListener("click", (e) => act("pause", e.currentTarget));
  $("resume-run").addEventListener("click", (e) => act("resume", e.currentTarget));

  // ---------- checkpoints and events ----------
  /** "11-22 03:21:48" (UTC), or only the time when `short`; the full timestamp on hover. */
  function fmtTime(value, short) {
    const d = parseDate(value);
    if (!d) return el("span", { className: "faint" }, "–");
    const iso = d.toISOString();
    return el("span", { className: "nowrap mono", title: iso.replace("T", " ").slice(0, 19) + " UTC" },
      (short ? "" : iso.slice(5, 10) + " ") + iso.slice(11, 19));
  }

  async function loadCheckpoints() {
    const list = await api(base + "/checkpoints");
    const tbody = $("checkpoints-table").tBodies[0];
    $("checkpoint-summary").textContent = list.count ? list.count + (list.count === 1 ? " saved" : " saved") : "";
    if (!list.data.length) {
      tbody.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 5 },
        R.isTerminal(run.status) ? "No checkpoints were saved." : "No checkpoints yet.")));
      return;
    }
    const rows = list.data.slice().sort((a, b) => b.step - a.step);
    tbody.replaceChildren(...rows.map((c) => {
      const m = c.metrics || {};
      return el("tr", { dataset: { step: String(c.step) } },
        el("td", { className: "num" }, el("b", {}, fmtNum(c.step))),
        el("td", { className: "num" }, R.fmtMetric(m.loss)),
        el("td", { className: "num" }, R.fmtMetric(m.eval_loss)),
        el("td", {}, fmtTime(c.created_at, true)),
        el("td", { className: "actions nowrap" },
          el("button", { type: "button", className: "btn btn-sm", dataset: { exportStep: String(c.step), kind: "merged" },
            title: "Merge this checkpoint into the base model (Hugging Face safetensors)" }, "Merge"),
          el("button", { type: "button", className: "btn btn-sm", dataset: { exportStep: String(c.step), kind: "adapter" },
            title: "Export this checkpoint as a PEFT adapter" }, "Adapter")));
    }));
  }

  async function loadEvents() {
    const list = await api(base + "/events?limit=200");
    const tbody = $("events-table").tBodies[0];
    if (!list.data.length) {
      tbody.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 3 }, "No events yet.")));
      return;
    }
    tbody.replaceChildren(...list.data.map((e) => {
      const level = ["info", "warning", "warn", "error", "debug"].includes(e.level) ? e.level : "info";
      return el("tr", { dataset: { id: String(e.id) }, className: "ev-" + level },
        el("td", {}, fmtTime(e.created_at)),
        el("td", {}, el("span", { className: "level level-" + level }, e.level)),
        el("td", { className: "ev-message" }, e.message));
    }));
  }

  /** The watch stream sends metric rows by step (`step > last step sent`), so an eval row that the
   * worker records for step N after step N's training row has gone out never arrives over it.
   * The worker commits step N's eval row no later than step N+1's training row, so once rows up to
   * step M have been read in one go, every eval row up to M - 1 is known: `evalChecked` is that step.
   * Each refresh reads the rows after it (about what the stream sent meanwhile) and merges the evals. */
  let evalChecked = -1;

  function maxStep(rows) {
    let m = null;
    for (const r of rows) if (typeof r.step === "number" && (m === null || r.step > m)) m = r.step;
    return m;
  }

  async function reconcileEval() {
    const done = R.isTerminal(run.status);
    if (done ? evalChecked >= run.step : run.step <= evalChecked + 1) return;
    const list = await api(base + "/metrics?since_step=" + evalChecked);
    const found = R.pointsOf(list.data, "eval_loss");
    const m = maxStep(list.data);
    if (m !== null) evalChecked = Math.max(evalChecked, done ? m : m - 1);
    else if (done) evalChecked = run.step;
    if (!found.length) return;
    const evals = series.eval_loss;
    R.appendPoints(evals, found, true);
    const last = evals[evals.length - 1];
    if (!latest.eval_loss || last.x >= latest.eval_loss.step) latest.eval_loss = { step: last.x, value: last.y };
    renderCharts();
    renderCards();
  }

  let sideTimer = null;
  let sideLast = 0;
  /** Re-read checkpoints and events: now if the last read was 2 s ago, else once when 2 s have passed. */
  function refreshSide() {
    if (sideTimer) return;
    const wait = Math.max(0, sideLast + 2000 - Date.now());
    sideTimer = setTimeout(async () => {
      sideLast = Date.now();
      try {
        await Promise.all([loadCheckpoints(), loadEvents(), reconcileEval()]);
      } catch (err) {
        console.warn("could not refresh checkpoints/events", err);
      } finally {
        sideTimer = null;
      }
    }, wait);
  }

  // ---------- live ----------
  function render() {
    renderHeader();
    renderActions();
    renderProgress();
    renderCards();
    renderCharts();
  }

  let firstEvent = true;

  function update(data) {
    if (!data || !data.run) return;
    const before = run.status;
    run = data.run;
    addMetrics(data.metrics || []);
    if (firstEvent && data.metrics) {
      // A stream's first event carries every row so far, read at once: nothing before it is missing.
      firstEvent = false;
      const m = maxStep(data.metrics);
      if (m !== null) evalChecked = Math.max(evalChecked, R.isTerminal(run.status) ? m : m - 1);
    }
    const last = samples[samples.length - 1];
    if (!last || last.step !== run.step) samples.push({ t: Date.now(), step: run.step });
    if (samples.length > 200) samples.shift();
    if (before !== run.status) renderConfig();
    render();
    refreshSide();
  }

  makeCharts();
  renderConfig();
  render();
  refreshSide();
  loadDatasetNames();
  setInterval(() => { if (run.status === "running") renderClock(); }, 1000);

  const live = $("live");
  const source = watch(base + "?watch=true", {
    update: (data, src) => {
      update(data);
      if (R.isTerminal(run.status)) {
        src.close(); // nothing more will change
        live.classList.remove("on");
        live.textContent = "Finished";
      }
    },
    deleted: (_, src) => {
      src.close();
      live.classList.remove("on");
      live.textContent = "Deleted";
      $("action-error").textContent = "This run no longer exists.";
      $("action-error").hidden = false;
    },
  }, live);
  window.__runSource = source;
})();
