/* The arena (/arena): two endpoints answer one prompt side by side, streamed over
 * POST /api/v1/arena/battles/{id}/answers/{a|b} (server-sent events that name no model); the vote
 * reveals which was which. Below: the standings over every vote, and the export of the votes as a
 * preference dataset. */
(function () {
  "use strict";
  const { el, api, postEvents } = window.TD;
  const $ = (id) => document.getElementById(id);
  if (!$("arena-page")) return;
  let battle = null;
  let position = 0;

  function fail(err) {
    $("arena-error").textContent = err.message;
    $("arena-error").hidden = false;
  }

  /** Stream one side's answer into its panel; resolves true once it is whole. */
  async function stream(side) {
    const box = $("arena-answer-" + side);
    box.textContent = "";
    const url = "/api/v1/arena/battles/" + encodeURIComponent(battle.id) + "/answers/" + side;
    for await (const { event, data } of postEvents(url)) {
      const payload = JSON.parse(data);
      if (event === "token") box.textContent += payload.text;
      else if (event === "done") { box.dataset.done = "true"; return true; }
      else if (event === "error") throw new Error("Model " + side.toUpperCase() + ": " + payload.detail);
    }
    return false;
  }

  async function ask(event) {
    event.preventDefault();
    $("arena-error").hidden = true;
    const dataset = $("arena-dataset").value;
    const body = { endpoint_ids: [$("arena-left").value, $("arena-right").value], max_tokens: Number($("arena-tokens").value) };
    if (dataset) Object.assign(body, { dataset_id: dataset, position });
    else body.prompt = $("arena-prompt").value;
    $("arena-ask").disabled = true;
    try {
      battle = await api("/api/v1/arena/battles", { method: "POST", json: body });
      if (dataset) {
        $("arena-prompt").value = battle.messages.filter((m) => m.role === "user").slice(-1).map((m) => m.content).join("");
        position += 1;
        $("arena-position").textContent = "conversation " + position + "; the next ask takes the one after";
      }
      $("arena-answers").hidden = $("arena-vote").hidden = false;
      $("arena-voted").textContent = "";
      for (const side of ["a", "b"]) { $("arena-name-" + side).textContent = ""; delete $("arena-answer-" + side).dataset.done; }
      document.querySelectorAll("[data-vote]").forEach((b) => { b.disabled = true; });
      const whole = await Promise.all([stream("a"), stream("b")]);
      if (whole.every(Boolean)) document.querySelectorAll("[data-vote]").forEach((b) => { b.disabled = false; });
    } catch (err) {
      fail(err);
    } finally {
      $("arena-ask").disabled = false;
    }
  }

  async function vote(choice) {
    try {
      battle = await api("/api/v1/arena/battles/" + encodeURIComponent(battle.id) + "/vote", { method: "POST", json: { vote: choice } });
      document.querySelectorAll("[data-vote]").forEach((b) => { b.disabled = true; });
      battle.sides.forEach((s, i) => { $("arena-name-" + "ab"[i]).textContent = s.model + " (" + s.endpoint_id + ")"; });
      $("arena-voted").textContent = "Voted: " + { a: "A is better", b: "B is better", tie: "a tie", both_bad: "both are bad" }[choice];
      loadStandings();
    } catch (err) {
      fail(err);
    }
  }

  async function loadStandings() {
    const board = await api("/api/v1/arena/leaderboard");
    $("arena-votes").textContent = board.votes + (board.votes === 1 ? " vote" : " votes");
    if (!board.data.length) return;
    const r = (v) => v.toFixed(0);
    $("arena-standings").tBodies[0].replaceChildren(...board.data.map((s) => el("tr", { dataset: { model: s.model } },
      el("td", { className: "mono" }, s.model), el("td", { className: "num" }, r(s.bt)), el("td", { className: "num" }, r(s.elo)),
      el("td", { className: "num" }, (100 * s.win_rate).toFixed(0) + "%"), el("td", { className: "num" }, String(s.wins)),
      el("td", { className: "num" }, String(s.ties)), el("td", { className: "num" }, String(s.losses)),
      el("td", { className: "num" }, String(s.both_bad)))));
  }

  $("arena-export").addEventListener("click", async () => {
    try {
      const made = await api("/api/v1/arena/export", { method: "POST", json: {} });
      $("arena-exported").replaceChildren("Registered as dataset ", el("a", { className: "mono", id: "arena-dataset-link", href: "/datasets/" + encodeURIComponent(made.id) }, made.id), " (being validated).");
      $("arena-exported").hidden = false;
    } catch (err) {
      fail(err);
    }
  });

  document.addEventListener("DOMContentLoaded", async () => {
    $("arena-form").addEventListener("submit", ask);
    document.querySelectorAll("[data-vote]").forEach((b) => b.addEventListener("click", () => vote(b.dataset.vote)));
    $("arena-dataset").addEventListener("change", () => { position = 0; $("arena-position").textContent = ""; });
    try {
      const ready = (await api("/api/v1/endpoints?limit=1000")).data.filter((x) => x.status === "ready");
      const options = () => ready.map((x) => el("option", { value: x.id }, x.model + " · " + x.id));
      $("arena-left").replaceChildren(...options());
      $("arena-right").replaceChildren(...options());
      if (ready.length > 1) $("arena-right").selectedIndex = 1;
      if (ready.length < 2) fail(new Error("The arena needs two ready endpoints: deploy another artifact first."));
      const sets = (await api("/api/v1/datasets?limit=1000&status=ready")).data;
      $("arena-dataset").append(...sets.map((d) => el("option", { value: d.id }, d.filename + " · " + d.id)));
      await loadStandings();
    } catch (err) {
      fail(err);
    }
  });
})();
