/* Shared helpers for every dashboard page: exposed as window.TD.
 * User content is only ever put into the page with textContent (never innerHTML). */
(function () {
  "use strict";

  function csrfToken() {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  }

  /** Headers for a state-changing request made with the session cookie. */
  function csrfHeaders(headers) {
    return Object.assign({ "X-CSRF-Token": csrfToken() }, headers || {});
  }

  /** Pull a readable message out of an API error body ({detail: str | [{loc, msg}]}). */
  function errorMessage(body, fallback) {
    const detail = body && body.detail;
    if (typeof detail === "string") return detail;
    if (Array.isArray(detail) && detail.length) {
      return detail.map((d) => {
        const loc = Array.isArray(d.loc) ? d.loc.filter((p) => p !== "body").join(".") : "";
        return (loc ? loc + ": " : "") + (d.msg || JSON.stringify(d));
      }).join("; ");
    }
    if (body && body.error && body.error.message) return body.error.message;
    return fallback || "Request failed";
  }

  /** fetch() the JSON API with the session cookie; throws Error(message) on a non-2xx answer. */
  async function api(path, options) {
    const opts = Object.assign({ method: "GET", credentials: "same-origin" }, options || {});
    opts.headers = Object.assign({ Accept: "application/json" }, opts.headers || {});
    if (opts.method !== "GET" && opts.method !== "HEAD") opts.headers = csrfHeaders(opts.headers);
    if (opts.json !== undefined) {
      opts.body = JSON.stringify(opts.json);
      opts.headers["Content-Type"] = "application/json";
      delete opts.json;
    }
    const res = await fetch(path, opts);
    const text = await res.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    if (!res.ok) {
      const err = new Error(errorMessage(body, res.status + " " + res.statusText));
      err.status = res.status;
      err.body = body;
      throw err;
    }
    return body;
  }

  // ---------- formatters ----------
  const nf = new Intl.NumberFormat("en-US");

  function fmtNum(n, digits) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    if (digits !== undefined) return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits });
    return nf.format(n);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    let size = Number(n);
    const units = ["B", "KB", "MB", "GB", "TB"];
    for (const unit of units) {
      if (size < 1024 || unit === "TB") return unit === "B" ? size.toFixed(0) + " B" : size.toFixed(1) + " " + unit;
      size /= 1024;
    }
    return n + " B";
  }

  function fmtMB(n) {
    return (Number(n) / (1024 * 1024)).toFixed(2) + " MB";
  }

  /** API timestamps are ISO 8601; ones without a zone are UTC. */
  function parseDate(value) {
    if (!value) return null;
    if (value instanceof Date) return value;
    const s = String(value);
    const zoned = /([zZ]|[+-]\d\d:?\d\d)$/.test(s);
    const d = new Date(zoned ? s : s + "Z");
    return Number.isNaN(d.getTime()) ? null : d;
  }

  function pad(n) { return String(n).padStart(2, "0"); }

  /** "2026-11-22 14:03" in UTC, the same as the server-rendered dates. */
  function fmtDate(value) {
    const d = parseDate(value);
    if (!d) return "–";
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) +
      " " + pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
  }

  function fmtAgo(value) {
    const d = parseDate(value);
    if (!d) return "never";
    const s = Math.max(0, Math.round((Date.now() - d.getTime()) / 1000));
    if (s < 5) return "just now";
    if (s < 60) return s + "s ago";
    if (s < 3600) return Math.floor(s / 60) + "m ago";
    if (s < 86400) return Math.floor(s / 3600) + "h ago";
    return Math.floor(s / 86400) + "d ago";
  }

  // ---------- DOM ----------
  /** el("td", {className: "num", dataset: {line: 7}}, "text", childNode, ...): strings become text nodes. */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "className") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const STATUS_CLASSES = ["validating", "ready", "invalid", "online", "offline", "active", "revoked"];

  /** A status pill: <span class="pill pill-ready">ready</span>. Pass `node` to update one in place. */
  function statusPill(status, node) {
    const pill = node || el("span");
    pill.className = "pill pill-" + (STATUS_CLASSES.includes(status) ? status : "other") + (node && node.classList.contains("pill-lg") ? " pill-lg" : "");
    pill.textContent = status;
    pill.title = status === "validating" ? "Validation in progress" : status;
    return pill;
  }

  // ---------- server-sent events ----------
  /** Follow an SSE stream: handlers maps event names to fn(parsedData). `indicator` gets class "on" while connected. */
  function watch(url, handlers, indicator) {
    const source = new EventSource(url);
    const setLive = (on, label) => {
      if (!indicator) return;
      indicator.classList.toggle("on", on);
      indicator.textContent = label;
    };
    source.onopen = () => setLive(true, "Live");
    source.onerror = () => setLive(false, source.readyState === EventSource.CLOSED ? "Disconnected" : "Reconnecting…");
    // The server ends a stream whose session ended (password changed, account disabled): log in again.
    source.addEventListener("unauthorized", () => {
      source.close();
      setLive(false, "Signed out");
      window.location.assign("/login?next=" + encodeURIComponent(window.location.pathname + window.location.search));
    });
    for (const [name, fn] of Object.entries(handlers)) {
      source.addEventListener(name, (event) => {
        let data = null;
        try { data = event.data ? JSON.parse(event.data) : null; } catch (err) { console.error("bad SSE data", err); return; }
        fn(data, source);
      });
    }
    window.addEventListener("pagehide", () => source.close());
    return source;
  }

  // ---------- page-wide behaviours ----------
  /** Keep "x ago" labels fresh: <span data-ago="ISO">. */
  function refreshAgo(root) {
    (root || document).querySelectorAll("[data-ago]").forEach((node) => {
      node.textContent = fmtAgo(node.dataset.ago);
      const d = parseDate(node.dataset.ago);
      if (d) node.title = d.toISOString().replace("T", " ").slice(0, 19) + " UTC";
    });
  }

  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return;
    }
    const area = el("textarea", { style: "position:fixed;opacity:0" });
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }

  document.addEventListener("DOMContentLoaded", () => {
    // <div data-replace-url="/path">: a page a POST made; a reload is a plain GET of /path.
    const replace = document.querySelector("[data-replace-url]");
    if (replace) history.replaceState(null, "", replace.dataset.replaceUrl);

    refreshAgo();
    setInterval(refreshAgo, 5000);

    // <button data-copy-target="#id">: copies the target's text.
    document.querySelectorAll("[data-copy-target]").forEach((button) => {
      button.addEventListener("click", async () => {
        const target = document.querySelector(button.dataset.copyTarget);
        if (!target) return;
        const label = button.textContent;
        try {
          await copyText(target.textContent.trim());
          button.textContent = "Copied";
        } catch (_) {
          button.textContent = "Copy failed";
        }
        setTimeout(() => { button.textContent = label; }, 1600);
      });
    });

    // <form data-confirm="Sure?">: asks first.
    document.querySelectorAll("form[data-confirm]").forEach((form) => {
      form.addEventListener("submit", (event) => {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    });
  });

  /**
   * POST and read the reply as server-sent events: yields {event, data} ("message" when the event is
   * unnamed; data as sent, a string) until the stream ends. A reply that is not 2xx throws the
   * server's message. (EventSource cannot POST, so the stream is read here.)
   */
  async function* postEvents(url, { headers = {}, body } = {}) {
    const res = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: csrfHeaders({ Accept: "text/event-stream", ...headers }),
      body,
    });
    if (!res.ok) {
      let reply = null;
      try { reply = await res.json(); } catch (_) { reply = null; }
      throw new Error(errorMessage(reply, res.status + " " + res.statusText));
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const ev of events) {
        const data = (ev.match(/^data: ?(.*)$/m) || [])[1];
        if (data !== undefined) yield { event: (ev.match(/^event: ?(.*)$/m) || [])[1] || "message", data };
      }
    }
  }

  window.TD = {
    csrfToken, csrfHeaders, api, errorMessage, postEvents,
    fmtNum, fmtBytes, fmtMB, fmtDate, fmtAgo, parseDate,
    el, statusPill, watch, refreshAgo, copyText,
  };
})();
