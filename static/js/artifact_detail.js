/* One artifact, live over /api/v1/artifacts/{id}?watch=true: progress in bytes, then its files
 * (with download links) and the verification of a merged model. */
(function () {
  "use strict";
  const { el, api, watch, fmtBytes } = window.TD;
  const $ = (id) => document.getElementById(id);
  const artifact = JSON.parse($("artifact-data").textContent);
  const base = "/api/v1/artifacts/" + encodeURIComponent(artifact.id);

  function render(a) {
    const pill = $("artifact-status");
    pill.className = "pill pill-lg pill-run-" + a.status;
    pill.textContent = a.status;
    const done = a.status === "succeeded";
    const pct = done ? 100 : a.bytes_total ? (100 * a.bytes_done) / a.bytes_total : 0;
    $("progress-bar").style.width = pct.toFixed(1) + "%";
    $("progress-bar").className = "progress-bar" + (done ? " done" : a.status === "failed" ? " bad" : "");
    $("progress-percent").textContent = a.bytes_total ? pct.toFixed(0) + "%" : "";
    $("progress-bytes").textContent = a.bytes_total ? fmtBytes(a.bytes_done) + " of " + fmtBytes(a.bytes_total) : "";
    $("progress-note").textContent = a.status === "queued" ? a.waiting || "waiting for a worker of the run's pool" : a.status;
    $("artifact-error").textContent = a.error || "";
    $("artifact-error").hidden = !a.error;

    $("files-summary").textContent = a.files.length ? a.files.length + " files, " + fmtBytes(a.size_bytes) : "";
    if (done) {
      $("files-table").tBodies[0].replaceChildren(...a.files.map((f) => el("tr", {},
        el("td", {}, el("a", { href: base + "/files/" + f.path, download: "" }, f.path)),
        el("td", { className: "num" }, fmtBytes(f.size)),
        el("td", { className: "mono small", title: f.sha256 }, f.sha256.slice(0, 16) + "…"))));
    }
    const v = a.verification;
    const rows = v ? [
      ["result", v.passed ? "passed" : "failed"],
      ["max |logit difference|", Number(v.max_abs_diff).toExponential(2) + " (tolerance " + v.tolerance + ")"],
      ["top-token agreement", (100 * v.argmax_agreement).toFixed(1) + "% (at least " + (100 * v.min_argmax_agreement).toFixed(0) + "%)"],
      ["compared", (v.prompts || "?") + " prompts, " + (v.positions || "?") + " positions, " + (v.dtype || "")],
    ] : [["result", a.kind === "adapter" ? "not applicable (an adapter is the LoRA itself)" : "after the merge"]];
    $("verification").replaceChildren(...rows.flatMap(([k, val]) => [el("dt", {}, k), el("dd", {}, val)]));
  }

  // Deploy (a merged model that succeeded): a pool, then the new endpoint's page.
  async function setUpDeploy() {
    const button = $("deploy-button");
    if (!button) return;
    let pools = [];
    try {
      const answer = await api("/api/v1/pools");
      pools = Array.isArray(answer) ? answer : answer.data;
      $("deploy-pool").replaceChildren(...pools.map((p) => el("option", { value: p.name }, p.name + " (" + p.accelerator + ")")));
    } catch (_) {
      $("deploy-pool").replaceChildren(el("option", { value: "cpu" }, "cpu"));
    }
    // vLLM pools: replicas of the model (data parallel), each over chips / replicas (tensor parallel)
    function replicasFor() {
      const pool = pools.find((p) => p.name === $("deploy-pool").value);
      const vllm = pool && pool.accelerator !== "cpu" && pool.chips > 1;
      $("deploy-dp-wrap").hidden = !vllm;
      const divisors = vllm ? [...Array(pool.chips).keys()].map((i) => i + 1).filter((d) => pool.chips % d === 0) : [1];
      $("deploy-dp").replaceChildren(...divisors.map((d) =>
        el("option", { value: String(d) }, d === 1 ? "1 (TP " + (pool ? pool.chips : 1) + ")" : d + " (TP " + pool.chips / d + " each)")));
    }
    $("deploy-pool").addEventListener("change", replicasFor);
    replicasFor();
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        const body = { artifact_id: artifact.id, pool: $("deploy-pool").value, data_parallel_size: Number($("deploy-dp").value) || 1 };
        const endpoint = await api("/api/v1/endpoints", { method: "POST", json: body });
        location.href = "/endpoints/" + encodeURIComponent(endpoint.id);
      } catch (err) {
        $("artifact-error").textContent = err.message;
        $("artifact-error").hidden = false;
        button.disabled = false;
      }
    });
  }

  function showDeploy(a) {
    const actions = $("deploy-actions");
    if (actions) actions.hidden = !(a.status === "succeeded" && a.verification && a.verification.passed);
  }

  setUpDeploy();
  showDeploy(artifact);
  render(artifact);
  watch(base + "?watch=true", {
    update: (a, src) => {
      render(a);
      showDeploy(a);
      if (["succeeded", "failed"].includes(a.status)) {
        src.close();
        $("live").classList.remove("on");
        $("live").textContent = "Finished";
      }
    },
  }, $("live"));
})();
