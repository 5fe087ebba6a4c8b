/* Artifacts, live: /api/v1/artifacts?watch=true (with run_id= on a run's page) sends the list
 * whenever an artifact's status or merge progress changes. On a run's page, the Merge / Adapter
 * buttons of the checkpoints table create one. */
(function () {
  "use strict";
  const { el, api, watch, fmtBytes } = window.TD;
  const $ = (id) => document.getElementById(id);
  const runData = $("run-data");
  const run = runData ? JSON.parse(runData.textContent) : null; // null: every artifact of the user
  const base = "/api/v1/artifacts";

  function progressCell(a) {
    const pct = a.bytes_total ? Math.min(100, (100 * a.bytes_done) / a.bytes_total) : 0;
    const done = a.status === "succeeded";
    const bar = el("div", { className: "progress-bar" + (done ? " done" : a.status === "failed" ? " bad" : "") });
    bar.style.width = (done ? 100 : pct).toFixed(1) + "%";
    const label = done ? "done" : a.status === "queued" ? "waiting for a worker"
      : a.bytes_total ? fmtBytes(a.bytes_done) + " of " + fmtBytes(a.bytes_total) : a.status;
    return el("div", { className: "mini-progress" },
      el("div", { className: "progress", role: "progressbar", "aria-valuenow": String(Math.round(pct)) }, bar),
      el("span", { className: "small muted nowrap" }, label));
  }

  function verificationCell(a) {
    const v = a.verification;
    if (!v) return a.kind === "adapter" ? el("span", { className: "faint" }, "n/a") : el("span", { className: "faint" }, "–");
    const text = (v.passed ? "passed" : "failed") + " · Δ " + Number(v.max_abs_diff).toExponential(1)
      + " · top-1 " + (100 * v.argmax_agreement).toFixed(0) + "%";
    return el("span", { className: "tag " + (v.passed ? "tag-green" : "tag-red"),
      title: "merged checkpoint vs the LoRA model on fixed prompts: largest |logit difference| (tolerance " + v.tolerance + ") and top-token agreement" }, text);
  }

  function filesCell(a) {
    if (a.status !== "succeeded") return el("span", { className: "faint" }, "–");
    return el("details", {},
      el("summary", {}, a.files.length + " files"),
      el("ul", { className: "file-list" }, ...a.files.map((f) => el("li", {},
        el("a", { href: base + "/" + a.id + "/files/" + f.path, download: "" }, f.path),
        el("span", { className: "faint" }, " " + fmtBytes(f.size))))));
  }

  function render(list) {
    const tbody = $("artifacts-table").tBodies[0];
    if (!list.data.length) {
      tbody.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 9 },
        run && run.status === "succeeded" ? "No artifacts."
          : "No artifacts yet: a run's merged model is made when it succeeds.")));
      return;
    }
    tbody.replaceChildren(...list.data.map((a) => el("tr", { dataset: { id: a.id, kind: a.kind, status: a.status } },
      el("td", { className: "mono small", title: a.path }, el("a", { href: "/artifacts/" + encodeURIComponent(a.id) }, a.name)),
      el("td", {}, a.kind),
      el("td", { className: "num" }, String(a.checkpoint_step)),
      el("td", { title: a.error || "" }, el("span", { className: "pill pill-run-" + a.status }, a.status),
        a.error ? el("div", { className: "small error-text" }, a.error) : null),
      el("td", {}, progressCell(a)),
      el("td", { className: "num" }, a.size_bytes ? fmtBytes(a.size_bytes) : "–"),
      el("td", {}, verificationCell(a)),
      el("td", {}, filesCell(a)),
      el("td", {}, ["succeeded", "failed"].includes(a.status)
        ? el("button", { type: "button", className: "btn btn-sm btn-danger", dataset: { deleteArtifact: a.id } }, "Delete") : null))));
  }

  function showError(message) {
    $("artifact-error").textContent = message || "";
    $("artifact-error").hidden = !message;
  }

  document.addEventListener("click", async (event) => {
    const exportBtn = event.target.closest("[data-export-step]");
    const deleteBtn = event.target.closest("[data-delete-artifact]");
    if (!exportBtn && !deleteBtn) return;
    showError("");
    try {
      if (exportBtn) {
        exportBtn.disabled = true;
        await api(base, { method: "POST", json: {
          run_id: run && run.id, kind: exportBtn.dataset.kind, checkpoint_step: Number(exportBtn.dataset.exportStep) } });
      } else if (window.confirm("Delete this artifact and its files?")) {
        await api(base + "/" + encodeURIComponent(deleteBtn.dataset.deleteArtifact), { method: "DELETE" });
      }
    } catch (err) {
      showError(err.message);
    } finally {
      if (exportBtn) exportBtn.disabled = false;
    }
  });

  watch(base + "?" + (run ? "run_id=" + encodeURIComponent(run.id) + "&" : "") + "watch=true", { update: render },
    run ? null : $("live")); // on a run's page the indicator follows the run
})();
