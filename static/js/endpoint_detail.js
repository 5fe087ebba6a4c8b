/* One endpoint, live: its status and phase over /api/v1/endpoints/{id}?watch=true; TTFT (p50, p95) and
 * output tokens/s over the last hour, as the server computes them from its samples (gateway traffic and
 * probes; GET .../stats and the endpoint's `stats`), re-read every 3 s;
 * and a playground that streams chat replies through the gateway, showing each reply's TTFT and
 * tokens/s as this browser measured them; a benchmark (form, progress, levels, latency/throughput
 * curve); the model server's log tail; Stop and Restart. */
(function () {
  "use strict";
  const { el, api, watch, postEvents } = window.TD;
  const R = window.TDRuns;
  const $ = (id) => document.getElementById(id);
  let endpoint = JSON.parse($("endpoint-data").textContent);
  const base = "/api/v1/endpoints/" + encodeURIComponent(endpoint.id);
  const BUCKET_S = 15;
  const ACTIVE = ["pending", "starting", "ready", "stopping"];
  $("gateway-url").textContent = location.origin + "/v1";

  function render(e) {
    endpoint = e;
    const pill = $("endpoint-status");
    pill.className = "pill pill-lg pill-ep-" + e.status;
    pill.textContent = e.status;
    $("endpoint-phase").textContent = e.status === "starting" && e.phase ? e.phase + "…"
      : e.status === "pending" && e.waiting ? e.waiting : "";
    $("endpoint-cost").textContent = R.fmtUSD(e.cost_usd);
    $("endpoint-error").textContent = e.error || "";
    $("endpoint-error").hidden = !e.error;
    $("stop-button").disabled = !["pending", "starting", "ready"].includes(e.status);
    $("restart-button").disabled = ACTIVE.includes(e.status);
    $("chat-send").disabled = e.status !== "ready";
    $("bench-run").disabled = e.status !== "ready" || benchRunning;
  }

  $("stop-button").addEventListener("click", async () => {
    $("stop-button").disabled = true;
    try {
      render(await api(base + "/stop", { method: "POST" }));
    } catch (err) {
      $("endpoint-error").textContent = err.message;
      $("endpoint-error").hidden = false;
    }
  });

  $("restart-button").addEventListener("click", async () => {
    $("restart-button").disabled = true;
    try {
      render(await api(base + "/restart", { method: "POST" }));
      follow();
    } catch (err) {
      $("endpoint-error").textContent = err.message;
      $("endpoint-error").hidden = false;
      $("restart-button").disabled = false;
    }
  });

  async function refreshLog() {
    try {
      const res = await fetch(base + "/logs?tail=200", { credentials: "same-origin" });
      if (res.ok) {
        const box = $("endpoint-log");
        const atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
        box.textContent = (await res.text()) || "No output yet.";
        if (atEnd) box.scrollTop = box.scrollHeight;
      }
    } catch (_) { /* the next refresh tries again */ }
    if (ACTIVE.includes(endpoint.status)) setTimeout(refreshLog, 3000);
  }

  // ---------- benchmark ----------
  const B = window.TDBench;
  const benchChart = B.curveChart($("bench-chart"));
  let benchRunning = false;
  let benchShown = null; // the benchmark on show: the one Cancel cancels

  function showBenchmark(b) {
    $("bench-progress").hidden = b.status === "succeeded";
    const pct = b.requests_total ? (100 * b.requests_done) / b.requests_total : 0;
    $("bench-bar").style.width = pct.toFixed(1) + "%";
    $("bench-progress-text").textContent = b.requests_done + " / " + b.requests_total + " requests";
    $("bench-status").className = "pill pill-run-" + b.status;  // the same states as a run's
    $("bench-status").textContent = b.status;
    $("bench-error").textContent = b.error || "";
    $("bench-error").hidden = !b.error;
    $("bench-results").hidden = b.results.length === 0;
    $("bench-summary").textContent = B.summary(b);
    $("bench-table").replaceChildren(B.levelTable(b));
    B.setCurves(benchChart, [b]);
    benchRunning = ["queued", "running"].includes(b.status);
    $("bench-run").disabled = benchRunning || endpoint.status !== "ready";
    benchShown = b;
    $("bench-cancel").hidden = !benchRunning;
    $("bench-cancel").disabled = b.cancel_requested;
    $("bench-cancel").textContent = b.cancel_requested ? "Cancelling…" : "Cancel";
  }

  // Cancel: the worker stops sending requests at its next beat (a second or so); the watch shows it end.
  $("bench-cancel").addEventListener("click", async () => {
    if (!benchShown) return;
    $("bench-cancel").disabled = true;
    try {
      showBenchmark(await api("/api/v1/benchmarks/" + encodeURIComponent(benchShown.id) + "/cancel", { method: "POST" }));
    } catch (err) {
      $("bench-error").textContent = err.message;
      $("bench-error").hidden = false;
      $("bench-cancel").disabled = false;
    }
  });

  $("bench-mode").addEventListener("change", () => {
    const rate = $("bench-mode").value === "rate";
    $("bench-levels-label").textContent = rate ? "requests / s" : "concurrency";
    $("bench-levels").value = rate ? "1, 4" : "1, 4, 16";
    $("bench-max-wrap").hidden = !rate;
  });
  $("bench-dataset").addEventListener("change", () => { $("bench-input-wrap").hidden = !!$("bench-dataset").value; });

  $("bench-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const rate = $("bench-mode").value === "rate";
    const levels = $("bench-levels").value.split(/[\s,]+/).filter(Boolean).map(Number);
    const body = {
      endpoint_id: endpoint.id, mode: rate ? "rate" : "concurrency",
      num_prompts: Number($("bench-prompts").value), input_len: Number($("bench-input").value),
      output_len: Number($("bench-output").value), dataset_id: $("bench-dataset").value || null,
    };
    if (rate) {
      body.request_rates = levels;
      if ($("bench-max").value) body.max_concurrency = Number($("bench-max").value);
    } else {
      body.concurrency = levels;
    }
    const slo = {};
    if ($("bench-slo-ttft").value) slo.ttft = Number($("bench-slo-ttft").value);
    if ($("bench-slo-tpot").value) slo.tpot = Number($("bench-slo-tpot").value);
    if (Object.keys(slo).length) body.goodput = slo;
    $("bench-run").disabled = true;
    try {
      const b = await api("/api/v1/benchmarks", { method: "POST", json: body });
      showBenchmark(b);
      followBenchmark(b.id);
    } catch (err) {
      $("bench-error").textContent = err.message;
      $("bench-error").hidden = false;
      $("bench-run").disabled = endpoint.status !== "ready";
    }
  });

  function followBenchmark(id) {
    watch("/api/v1/benchmarks/" + encodeURIComponent(id) + "?watch=true", {
      update: (data, src) => {
        showBenchmark(data);
        if (!["queued", "running"].includes(data.status)) src.close();
      },
    });
  }

  async function loadBenchmarks() {
    try {
      const datasets = await api("/api/v1/datasets?limit=200");
      for (const d of datasets.data.filter((x) => x.status === "ready")) {
        $("bench-dataset").append(el("option", { value: d.id }, d.filename + " (" + d.id + ")"));
      }
      const latest = (await api("/api/v1/benchmarks?limit=1&endpoint_id=" + encodeURIComponent(endpoint.id))).data[0];
      if (latest) showBenchmark(latest);
      if (latest && ["queued", "running"].includes(latest.status)) followBenchmark(latest.id);
    } catch (_) { /* the form still works */ }
  }

  // ---------- charts ----------
  const series_ = { p50: [], p95: [], tps: [], server: [] };
  const charts = {};
  const minutesAgo = { x: { title: { display: true, text: "minutes ago" }, ticks: { callback: (v) => (-v).toFixed(0) } } };
  const timeTitle = { tooltip: { callbacks: { title: (items) => (items.length ? (-items[0].parsed.x).toFixed(1) + " min ago" : "") } } };

  function makeCharts() {
    if (!window.Chart) return;
    charts.ttft = new window.Chart($("ttft-chart"), {
      type: "line",
      data: { datasets: [
        R.lineDataset("p50", "#4f46e5", { data: series_.p50, pointRadius: 2 }),
        R.lineDataset("p95", "#d97706", { data: series_.p95, pointRadius: 2, borderDash: [5, 4] }),
      ] },
      options: R.lineOptions({ scales: Object.assign({ y: { beginAtZero: true, title: { display: true, text: "ms" } } }, minutesAgo),
        plugins: Object.assign({ legend: { display: true, position: "top", align: "end" } }, timeTitle) }),
    });
    charts.tps = new window.Chart($("tps-chart"), {
      type: "line",
      data: { datasets: [
        R.lineDataset("through Tunedeck (gateway + probes)", "#16a34a", { data: series_.tps, pointRadius: 2, fill: true }),
        R.lineDataset("server, all requests", "#0891b2", { data: series_.server, pointRadius: 2, borderDash: [5, 4] }),
      ] },
      options: R.lineOptions({ scales: Object.assign({ y: { beginAtZero: true, title: { display: true, text: "tokens / s" } } }, minutesAgo),
        plugins: Object.assign({ legend: { display: true, position: "top", align: "end" } }, timeTitle) }),
    });
  }

  function fill(target, points) {
    target.splice(0, target.length);
    for (const p of points) target.push(p);
  }

  const ms = (s) => (1000 * s).toFixed(0) + " ms";

  // The figures come from the server (GET .../stats per bucket, and the endpoint's own `stats`): the
  // same SQL that the API's clients read, no second computation here.
  function renderFigures(series, stats) {
    const now = Date.now();
    const at = (p) => -(now - window.TD.parseDate(p.at).getTime()) / 60000;
    const p50 = [], p95 = [], tps = [], server = [];
    for (const p of series.points) {
      const all = p.figures.all;
      if (all.ttft_p50_s !== null) {
        p50.push({ x: at(p), y: 1000 * all.ttft_p50_s });
        p95.push({ x: at(p), y: 1000 * all.ttft_p95_s });
      }
      tps.push({ x: at(p), y: all.output_tokens_per_s });
      if (all.server_tokens_per_s !== null) server.push({ x: at(p), y: all.server_tokens_per_s });
    }
    fill(series_.p50, p50); fill(series_.p95, p95); fill(series_.tps, tps); fill(series_.server, server);
    for (const c of Object.values(charts)) c.update("none");
    $("ttft-empty").hidden = p50.length > 0;
    $("tps-empty").hidden = tps.length > 0 || server.length > 0;
    const hour = stats.last_1h.all, recent = stats.last_5m.all;
    $("ttft-summary").textContent = hour.ttft_p50_s !== null
      ? "last hour: p50 " + ms(hour.ttft_p50_s) + " · p95 " + ms(hour.ttft_p95_s) + " · " + hour.requests + " requests" +
        (hour.errors ? " · " + hour.errors + " errors" : "")
      : "";
    $("tps-summary").textContent = recent.requests
      ? "last 5 min: " + recent.output_tokens_per_s.toFixed(1) + " tokens/s" +
        (recent.itl_p50_s !== null ? " · ITL p50 " + ms(recent.itl_p50_s) : "")
      : "";
  }

  async function refreshSamples() {
    try {
      const [series, current] = await Promise.all([api(base + "/stats?minutes=60&bucket_s=" + BUCKET_S), api(base)]);
      renderFigures(series, current.stats);
      render(current);  // its cost grows while it runs
    } catch (_) { /* the next refresh tries again */ }
    if (ACTIVE.includes(endpoint.status)) setTimeout(refreshSamples, 3000);
  }

  // ---------- playground ----------
  const history = [];

  function bubble(role, text) {
    const node = el("div", { className: "chat-msg chat-" + role }, text);
    $("chat-log").append(node);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return node;
  }

  $("chat-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text) return;
    $("chat-input").value = "";
    history.push({ role: "user", content: text });
    bubble("user", text);
    const reply = bubble("assistant", "");
    // the model's thought (reasoning_content), collapsed above its answer
    const thought = el("details", { className: "chat-thought", hidden: true });
    thought.append(el("summary", {}, "Thought"), el("div", { className: "chat-thought-text" }));
    const answer = el("span", { className: "chat-answer" });
    reply.append(thought, answer);
    const stats = el("div", { className: "chat-stats" }, "waiting for the first token…");
    $("chat-log").append(stats);
    $("chat-send").disabled = true;
    const started = performance.now();
    let first = null, last = null, tokens = null, content = "", reasoning = "";
    try {
      const events = postEvents("/v1/chat/completions", {
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({
          model: endpoint.model, messages: history, stream: true, stream_options: { include_usage: true },
          max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
          top_p: Number($("top-p").value),
          ...($("thinking").checked ? { chat_template_kwargs: { enable_thinking: true } } : {}),
        }),
      });
      for await (const { data } of events) {
        if (data !== "[DONE]") {
          const chunk = JSON.parse(data);
          if (chunk.usage) tokens = chunk.usage.completion_tokens;
          const d = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
          if (d.content || d.reasoning_content) {
            if (first === null) first = performance.now();
            last = performance.now();
          }
          if (d.reasoning_content) {
            reasoning += d.reasoning_content;
            thought.hidden = false;
            thought.querySelector(".chat-thought-text").textContent = reasoning;
          }
          if (d.content) {
            content += d.content;
            answer.textContent = content;
          }
        }
      }
      history.push({ role: "assistant", content });
      const parts = [];
      if (first !== null) parts.push("TTFT " + (first - started).toFixed(0) + " ms");
      if (tokens !== null) parts.push(tokens + " tokens");
      if (tokens > 1 && last > first) parts.push(((tokens - 1) / ((last - first) / 1000)).toFixed(0) + " tokens/s");
      stats.textContent = parts.join(" · ") || "no tokens";
    } catch (err) {
      history.pop();
      reply.remove();
      stats.textContent = err.message;
      stats.classList.add("text-error");
    } finally {
      $("chat-send").disabled = endpoint.status !== "ready";
    }
  });

  function follow() {
    refreshSamples();
    refreshLog();
    watch(base + "?watch=true", {
      update: (e, src) => {
        render(e);
        if (!ACTIVE.includes(e.status)) {
          src.close();
          $("live").classList.remove("on");
          $("live").textContent = "Finished";
          refreshLog();
        }
      },
    }, $("live"));
  }

  render(endpoint);
  makeCharts();
  follow();
  loadBenchmarks();
})();
