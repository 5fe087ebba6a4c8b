/* Helpers shared by the run pages (list, new, detail, compare): exposed as window.TDRuns.
 * Loaded after common.js; like it, only ever puts user content into the page with textContent. */
(function () {
  "use strict";
  const { el, fmtNum, parseDate } = window.TD;

  const STATUSES = ["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"];
  const TERMINAL = ["succeeded", "failed", "cancelled"];
  const ACTIVE = ["validating_files", "queued", "running", "paused"];

  const isTerminal = (status) => TERMINAL.includes(status);

  /** A run status pill, <span class="pill pill-run-running">running</span>; pass `node` to update in place. */
  function runPill(status, node) {
    const pill = node || el("span");
    const large = node && node.classList.contains("pill-lg");
    pill.className = "pill pill-run-" + (STATUSES.includes(status) ? status : "other") + (large ? " pill-lg" : "");
    pill.textContent = status;
    pill.title = status.replace("_", " ");
    return pill;
  }

  /** The pill plus the phase ("running · training"), for tables. */
  function statusCell(run) {
    const wrap = el("span", { className: "run-state" }, runPill(run.status));
    if (run.phase && !isTerminal(run.status)) wrap.append(el("span", { className: "phase" }, run.phase));
    return wrap;
  }

  // ---------- formatters ----------
  /** 1234567 -> "1.23M", 31e9 -> "31.0B". */
  function fmtCompact(n) {
    if (n === null || n === undefined || Number.isNaN(Number(n))) return "–";
    const v = Number(n);
    const abs = Math.abs(v);
    if (abs >= 1e12) return (v / 1e12).toFixed(2) + "T";
    if (abs >= 1e9) return (v / 1e9).toFixed(abs >= 1e11 ? 0 : abs >= 1e10 ? 1 : 2) + "B";
    if (abs >= 1e6) return (v / 1e6).toFixed(abs >= 1e8 ? 0 : abs >= 1e7 ? 1 : 2) + "M";
    if (abs >= 1e4) return (v / 1e3).toFixed(abs >= 1e5 ? 0 : 1) + "K";
    return fmtNum(v);
  }

  /** Memory given in GiB, shown in the unit that keeps it readable. */
  function fmtGiB(g) {
    if (g === null || g === undefined || Number.isNaN(Number(g))) return "–";
    const v = Number(g);
    if (v === 0) return "0 GiB";
    if (v >= 100) return v.toFixed(0) + " GiB";
    if (v >= 1) return v.toFixed(1) + " GiB";
    if (v >= 1 / 1024) return (v * 1024).toFixed(v * 1024 >= 100 ? 0 : 1) + " MiB";
    return Math.max(1, Math.round(v * 1024 * 1024)) + " KiB";
  }

  function fmtUSD(n) {
    if (n === null || n === undefined || Number.isNaN(Number(n))) return "–";
    const v = Number(n);
    if (v === 0) return "$0.00";
    if (Math.abs(v) < 0.01) return "$" + v.toPrecision(2);
    return "$" + v.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  }

  /** 42 -> "42s", 3725 -> "1h 02m", 0.25 -> "250 ms". */
  function fmtDuration(seconds) {
    if (seconds === null || seconds === undefined || Number.isNaN(Number(seconds))) return "–";
    const s = Number(seconds);
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 60) return Math.round(s) + "s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m " + String(Math.round(s % 60)).padStart(2, "0") + "s";
    const h = Math.floor(m / 60);
    if (h < 48) return h + "h " + String(m % 60).padStart(2, "0") + "m";
    return Math.floor(h / 24) + "d " + (h % 24) + "h";
  }

  /** Seconds between two API timestamps (`end` defaults to now); null when it has not started. */
  function elapsed(start, end) {
    const a = parseDate(start);
    if (!a) return null;
    const b = parseDate(end) || new Date();
    return Math.max(0, (b.getTime() - a.getTime()) / 1000);
  }

  /** Losses, learning rates and the like: a few significant digits, exponent for tiny values. */
  function fmtMetric(v, digits) {
    if (v === null || v === undefined || Number.isNaN(Number(v))) return "–";
    const x = Number(v);
    if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e6)) return x.toExponential(2);
    return x.toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 4 : digits });
  }

  /** A config value as text (null -> "–", lists joined). */
  function fmtValue(v) {
    if (v === null || v === undefined) return "–";
    if (Array.isArray(v)) return v.length ? v.join(", ") : "[]";
    if (typeof v === "boolean") return v ? "true" : "false";
    if (typeof v === "number") return Math.abs(v) > 0 && Math.abs(v) < 1e-3 ? v.toExponential() : String(v);
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  // ---------- metric series ----------
  /** Add points [{x: step, y}] to a series kept sorted by step. A point for the last step replaces
   * it. A point before it means a resumed run is repeating the steps after its checkpoint: by default
   * everything from that step on is dropped first; with `merge`, the point is slotted in by step.
   * (Only push and two-argument splice: Chart.js watches its data arrays through those.) */
  function appendPoints(series, points, merge) {
    for (const p of points) {
      const n = series.length;
      if (!n || p.x > series[n - 1].x) {
        series.push(p);
        continue;
      }
      let i = n;
      while (i > 0 && series[i - 1].x >= p.x) i--;
      if (merge) {
        series.splice(i, i < n && series[i].x === p.x ? 1 : 0, p);
      } else {
        series.splice(i, n - i);
        series.push(p);
      }
    }
    return series;
  }

  /** The {x, y} points of one metric key out of rows [{step, loss, ...}]. */
  function pointsOf(rows, key) {
    const out = [];
    for (const r of rows) {
      const v = r[key];
      if (v === null || v === undefined || typeof v !== "number" || !Number.isFinite(v)) continue;
      out.push({ x: r.step, y: v });
    }
    return out;
  }

  // ---------- charts ----------
  const PALETTE = ["#4f46e5", "#0891b2", "#d97706", "#db2777", "#16a34a", "#7c3aed", "#dc2626", "#0d9488", "#64748b", "#ca8a04"];
  const color = (i) => PALETTE[i % PALETTE.length];
  const alpha = (hex, a) => {
    const n = parseInt(hex.slice(1), 16);
    return "rgba(" + ((n >> 16) & 255) + ", " + ((n >> 8) & 255) + ", " + (n & 255) + ", " + a + ")";
  };

  const TICKS = { color: "#64708a", font: { size: 11 } };

  /** Options for a line chart over steps. */
  function lineOptions(extra) {
    const opts = {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      normalized: true,
      interaction: { mode: "nearest", axis: "x", intersect: false },
      plugins: {
        legend: { display: false, labels: { boxWidth: 12, boxHeight: 12, color: "#3d4759", font: { size: 12 } } },
        tooltip: { callbacks: { title: (items) => (items.length ? "step " + items[0].parsed.x : "") } },
      },
      scales: {
        x: {
          type: "linear",
          title: { display: true, text: "step", color: "#64708a" },
          ticks: Object.assign({ precision: 0, maxRotation: 0 }, TICKS),
          grid: { color: "#f1f3f7" },
        },
        y: { ticks: TICKS, grid: { color: "#eef1f5" } },
      },
    };
    return deepMerge(opts, extra || {});
  }

  function deepMerge(target, source) {
    for (const [k, v] of Object.entries(source)) {
      if (v && typeof v === "object" && !Array.isArray(v) && target[k] && typeof target[k] === "object") deepMerge(target[k], v);
      else target[k] = v;
    }
    return target;
  }

  function lineDataset(label, hex, extra) {
    return Object.assign({
      label,
      data: [],
      borderColor: hex,
      backgroundColor: alpha(hex, 0.12),
      borderWidth: 2,
      pointRadius: 0,
      pointHoverRadius: 4,
      tension: 0.15,
      spanGaps: true,
    }, extra || {});
  }

  /** RunConfig's field order (the server's embedded JSON arrives with sorted keys). */
  const CONFIG_ORDER = [
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "quantization", "learning_rate", "lr_schedule",
    "warmup_steps", "epochs", "max_steps", "batch_size", "grad_accum_steps", "max_seq_len", "packing",
    "assistant_only_loss", "enable_thinking", "seed", "validation_fraction", "eval_every_steps", "checkpoint_every_steps",
    "checkpoints_kept", "eval_every_checkpoint", "mesh_dp", "mesh_fsdp", "mesh_tp", "remat", "dtype",
  ];

  function configKeys(...configs) {
    const keys = [];
    for (const c of configs) for (const k of Object.keys(c || {})) if (!keys.includes(k)) keys.push(k);
    const rank = (k) => (CONFIG_ORDER.includes(k) ? CONFIG_ORDER.indexOf(k) : CONFIG_ORDER.length);
    return keys.sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  }

  // Evaluation metrics: a score in [0, 1] is shown as a percentage, higher is better; perplexity as it
  // is, lower is better.
  const LOWER_IS_BETTER = new Set(["perplexity"]);
  const evalScale = (m) => (LOWER_IS_BETTER.has(m) ? 1 : 100);
  const evalText = (m, v) => (v === null || v === undefined ? "–" : LOWER_IS_BETTER.has(m) ? Number(v).toFixed(2) : (100 * v).toFixed(1));
  const evalBetter = (m, a, b) => (LOWER_IS_BETTER.has(m) ? a < b : a > b);
  const evalAxis = (m) => (LOWER_IS_BETTER.has(m) ? m + " (lower is better)" : m + " (%)");

  window.TDRuns = {
    evalScale, evalText, evalBetter, evalAxis,
    CONFIG_ORDER, configKeys,
    STATUSES, TERMINAL, ACTIVE, isTerminal, runPill, statusCell,
    fmtCompact, fmtGiB, fmtUSD, fmtDuration, fmtMetric, fmtValue, elapsed,
    appendPoints, pointsOf, PALETTE, color, alpha, lineOptions, lineDataset,
  };
})();
