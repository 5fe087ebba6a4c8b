/* Endpoints, live: /api/v1/endpoints?watch=true sends the list whenever one changes. */
(function () {
  "use strict";
  const { el, watch, fmtAgo } = window.TD;
  const $ = (id) => document.getElementById(id);

  function render(body) {
    const rows = body.data.map((e) => el("tr", {},
      el("td", {}, el("a", { className: "mono", href: "/endpoints/" + e.id }, e.id)),
      el("td", { className: "mono" }, e.model),
      el("td", { className: "mono" }, e.pool),
      el("td", {}, el("span", { className: "pill pill-ep-" + e.status }, e.status + (e.status === "starting" && e.phase ? " · " + e.phase : ""))),
      el("td", { className: "muted" }, fmtAgo(e.ready_at || e.created_at))));
    $("endpoints-table").tBodies[0].replaceChildren(...(rows.length ? rows
      : [el("tr", { className: "empty" }, el("td", { colSpan: 5 }, "No endpoints yet: deploy a merged model from its artifact page."))]));
  }

  watch("/api/v1/endpoints?watch=true", { update: render }, $("live"));
})();
