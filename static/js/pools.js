/* Pools page: follow /api/v1/pools?watch=true and redraw the rows (hosts and online counts). */
(function () {
  "use strict";
  const { el, watch, fmtAgo } = window.TD;
  const body = document.getElementById("pools-body");

  function hosts(pool) {
    if (!pool.workers.length) return el("span", { className: "faint small" }, "No hosts have connected yet");
    return el("ul", { className: "hosts" }, pool.workers.map((w) =>
      el("li", { className: "host" },
        el("span", { className: "dot" + (w.online ? " on" : ""), "aria-hidden": "true" }),
        el("span", { className: "hostname" }, w.hostname),
        el("span", { className: "pill pill-" + (w.online ? "online" : "offline") }, w.online ? "online" : "offline"),
        el("span", { className: "seen" }, "seen ", el("span", { dataset: { ago: w.last_seen } }, fmtAgo(w.last_seen))),
      )));
  }

  function row(pool) {
    return el("tr", { dataset: { pool: pool.name } },
      el("td", {}, el("strong", {}, pool.name), pool.description ? el("div", { className: "small muted" }, pool.description) : null),
      el("td", {}, el("span", { className: "tag" }, pool.accelerator)),
      el("td", { className: "num" }, String(pool.chips)),
      el("td", { className: "num" }, "$" + Number(pool.price_per_chip_hour).toFixed(2)),
      el("td", { className: "online-cell" },
        el("span", { className: "online-count" + (pool.workers_online ? "" : " zero") }, pool.workers_online + " online")),
      el("td", { className: "hosts-cell" }, hosts(pool)),
    );
  }

  function render(list) {
    if (!list.data.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 6 }, "No pools yet.")));
      return;
    }
    body.replaceChildren(...list.data.map(row));
  }

  watch("/api/v1/pools?watch=true", { update: render }, document.getElementById("live"));
})();
