/* Pools page: follow /api/v1/pools?watch=true and redraw the rows (hosts and online counts). */
(function () {
  "use strict";
  const { el, watch, fmtAgo } = window.TD;
  const body = document.getElementById("pools-body");

  function host(w) {
    return el("li", { className: "host", dataset: { host: w.hostname } },
      el("span", { className: "dot" + (w.online ? " on" : ""), "aria-hidden": "true" }),
      w.host_index !== null ? el("span", { className: "host-index" }, "host " + w.host_index) : null,
      el("span", { className: "hostname" }, w.hostname),
      el("span", { className: "pill pill-" + (w.online ? "online" : "offline") }, w.online ? "online" : "offline"),
      el("span", { className: "seen" }, "seen ", el("span", { dataset: { ago: w.last_seen } }, fmtAgo(w.last_seen))));
  }

  function hosts(pool) {
    if (!pool.workers.length) return el("span", { className: "faint small" }, "No hosts have connected yet");
    if (pool.hosts_per_slice === 1) return el("ul", { className: "hosts" }, pool.workers.map(host));
    // A slice pool: its slices, each with its hosts by index and whether all of them are online.
    return el("div", { className: "slices" }, pool.slices.map((sl) => {
      const online = sl.hosts.filter((w) => w.online).length;
      return el("div", { className: "slice", dataset: { slice: sl.name } },
        el("div", { className: "slice-head" }, el("strong", {}, "slice " + sl.name), " ",
          el("span", { className: "pill pill-" + (sl.complete ? "online" : "offline") },
            online + " of " + pool.hosts_per_slice + " hosts online")),
        el("ul", { className: "hosts" }, sl.hosts.map(host)));
    }));
  }

  function row(pool) {
    return el("tr", { dataset: { pool: pool.name } },
      el("td", {}, el("strong", {}, pool.name), pool.description ? el("div", { className: "small muted" }, pool.description) : null),
      el("td", {}, el("span", { className: "tag" }, pool.accelerator)),
      el("td", { className: "num" }, pool.hosts_per_slice > 1
        ? String(pool.chips) + " (" + pool.hosts_per_slice + " × " + pool.chips_per_host + ")" : String(pool.chips)),
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
