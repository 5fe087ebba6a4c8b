/* New run: the launch form, the demo-dataset import, inline 422 errors and the live pre-flight panel.
 *
 * The body sent to POST /api/v1/runs and /api/v1/runs/estimate is built from the form: every input
 * with data-config="<field>" becomes config.<field>, typed by its data-type (int, float, int? / float?
 * = number or null, bool, str, str? = string or null, list = the checked boxes' values). */
(function () {
  "use strict";
  const { el, api, fmtNum } = window.TD;
  const { fmtCompact, fmtGiB, fmtUSD, fmtDuration } = window.TDRuns;
  const $ = (id) => document.getElementById(id);

  const form = $("run-form");
  const datasetSelect = $("dataset_id");
  const validationSelect = $("validation_dataset_id");
  const poolSelect = $("pool");
  const modelSelect = $("base_model");
  const launch = $("launch");
  const demoButton = $("import-demo");
  const demoStatus = $("demo-status");

  // ---------- the request body ----------
  function readConfig() {
    const config = {};
    for (const input of form.querySelectorAll("[data-config]")) {
      const key = input.dataset.config;
      const type = input.dataset.type;
      if (type === "list") {
        if (!config[key]) config[key] = [];
        if (input.checked) config[key].push(input.value);
        continue;
      }
      if (type === "bool") { config[key] = input.checked; continue; }
      const raw = input.value.trim();
      if (type === "str") config[key] = raw;
      else if (type === "str?") config[key] = raw || null;
      // Numbers: an empty optional field is null (the server's default); an empty required one is sent
      // as null too, so the server names it rather than us guessing a value.
      else config[key] = raw === "" ? null : Number(raw);
    }
    // Epochs OR max steps: max steps wins, so do not send both.
    if (config.max_steps !== null && config.max_steps !== undefined) config.epochs = null;
    return config;
  }

  function body() {
    const suffix = $("suffix").value.trim();
    return {
      base_model: modelSelect.value,
      dataset_id: datasetSelect.value,
      validation_dataset_id: validationSelect.value || null,
      pool: poolSelect.value,
      suffix: suffix || null,
      config: readConfig(),
      force: $("force").checked,
    };
  }

  // ---------- inline errors ----------
  const cleanMsg = (msg) => String(msg || "invalid").replace(/^Value error, /, "");

  function clearErrors() {
    form.querySelectorAll("[data-field].has-error").forEach((w) => w.classList.remove("has-error"));
    form.querySelectorAll(".field-error").forEach((n) => n.remove());
    $("form-error").hidden = true;
  }

  /** The wrapper for a loc like ["body", "config", "target_modules", 2]: the longest prefix that has one. */
  function wrapperFor(loc) {
    const path = (Array.isArray(loc) ? loc.slice(loc[0] === "body" ? 1 : 0) : []).map(String);
    for (let n = path.length; n > 0; n--) {
      const key = path.slice(0, n).join(".");
      const node = form.querySelector('[data-field="' + CSS.escape(key) + '"]');
      if (node) return node;
    }
    return null;
  }

  /** Show FastAPI's 422 detail next to the fields; returns the first wrapper (in page order) that got one. */
  function showErrors(detail, { scroll } = {}) {
    clearErrors();
    const general = [];
    const wrappers = [];
    for (const d of detail) {
      const wrapper = wrapperFor(d.loc);
      if (!wrapper) {
        const loc = Array.isArray(d.loc) ? d.loc.filter((p) => p !== "body").join(".") : "";
        general.push((loc ? loc + ": " : "") + cleanMsg(d.msg));
        continue;
      }
      wrapper.classList.add("has-error");
      wrapper.append(el("div", { className: "field-error", role: "alert" }, cleanMsg(d.msg)));
      if (!wrappers.includes(wrapper)) wrappers.push(wrapper);
      const details = wrapper.closest("details");
      if (details) details.open = true;
    }
    if (general.length) {
      $("form-error").textContent = general.join("; ");
      $("form-error").hidden = false;
    }
    wrappers.sort((a, b) => (a.compareDocumentPosition(b) & Node.DOCUMENT_POSITION_FOLLOWING ? -1 : 1));
    const first = wrappers[0] || (general.length ? $("form-error") : null);
    if (scroll && first) {
      first.scrollIntoView({ behavior: "smooth", block: "center" });
      const input = first.querySelector("input, select");
      if (input) input.focus({ preventScroll: true });
    }
    return first;
  }

  // ---------- pre-flight ----------
  let estimateSeq = 0;
  let estimateTimer = null;

  function scheduleEstimate() {
    clearTimeout(estimateTimer);
    estimateTimer = setTimeout(runEstimate, 300);
  }

  function setPanel(state) {
    $("pf-state").textContent = state;
  }

  async function runEstimate() {
    const seq = ++estimateSeq;
    if (!datasetSelect.value) {
      $("pf-empty").hidden = false;
      $("pf-body").hidden = true;
      $("pf-error").hidden = true;
      setPanel("");
      return;
    }
    setPanel("updating…");
    $("preflight").classList.add("busy");
    try {
      const est = await api("/api/v1/runs/estimate", { method: "POST", json: body() });
      if (seq !== estimateSeq) return;
      clearErrors();
      renderEstimate(est);
      setPanel("");
    } catch (err) {
      if (seq !== estimateSeq) return;
      if (err.status === 422 && err.body && Array.isArray(err.body.detail)) {
        showErrors(err.body.detail);
        $("pf-error").textContent = "Fix the highlighted settings to see an estimate.";
      } else {
        $("pf-error").textContent = "No estimate: " + err.message;
      }
      $("pf-error").hidden = false;
      $("pf-body").classList.add("stale");
      setPanel("");
    } finally {
      if (seq === estimateSeq) $("preflight").classList.remove("busy");
    }
  }

  function renderEstimate(e) {
    $("pf-empty").hidden = true;
    $("pf-error").hidden = true;
    $("pf-body").hidden = false;
    $("pf-body").classList.remove("stale");
    $("pf-params").textContent = fmtCompact(e.params);
    $("pf-params").title = fmtNum(e.params) + " parameters";
    $("pf-lora").textContent = fmtCompact(e.lora_params);
    $("pf-lora").title = fmtNum(e.lora_params) + " trainable parameters";
    $("pf-lora-pct").textContent = e.params ? ((100 * e.lora_params) / e.params).toPrecision(2) + "% of the base" : "";

    const weights = Number(e.weights_gib_per_chip) || 0;
    const lora = Number(e.lora_and_optimizer_gib_per_chip) || 0;
    const total = Number(e.total_gib_per_chip) || 0;
    const act = Math.max(0, total - weights - lora);
    const chip = Number(e.chip_memory_gib) || 0;
    const usable = Number(e.usable_gib_per_chip) || 0;  // the server's figure, not a second one here
    const scale = Math.max(chip, total) || 1;
    const pct = (v) => Math.min(100, (100 * v) / scale) + "%";
    $("pf-seg-weights").style.width = pct(weights);
    $("pf-seg-lora").style.width = pct(lora);
    $("pf-seg-act").style.width = pct(act);
    $("pf-limit").style.left = pct(usable);
    $("pf-membar").classList.toggle("over", !e.fits);
    $("pf-membar").setAttribute("aria-label", "Memory per chip: " + fmtGiB(total) + " of " + fmtGiB(chip));
    $("pf-mem-total").replaceChildren(el("b", {}, fmtGiB(total)), " of " + fmtGiB(chip));
    $("pf-mem-pct").textContent = chip ? ((100 * total) / chip).toFixed(total / chip < 0.01 ? 2 : 0) + "% of the chip" : "";
    $("pf-weights").textContent = fmtGiB(weights);
    $("pf-lora-mem").textContent = fmtGiB(lora);
    $("pf-act").textContent = fmtGiB(act);
    const remat = form.querySelector('[data-config="remat"]').value;
    $("pf-remat").textContent = remat === "none"
      ? "Activations with remat: " + fmtGiB(e.activations_gib_per_chip_with_remat)
      : "Activations without remat would be " + fmtGiB(e.activations_gib_per_chip);

    $("pf-warning").hidden = !!e.fits;
    $("pf-warning").textContent = e.fits ? "" : "Does not fit: " + (e.warning || "needs more memory than the chip has");
    $("pf-fits").hidden = !e.fits;
    $("pf-fits").textContent = "Fits in the " + fmtGiB(usable) + " usable of the chip's " + fmtGiB(chip);

    $("pf-mesh").textContent = e.mesh || "–";
    $("pf-tokens").textContent = e.tokens === null || e.tokens === undefined ? "–" : fmtCompact(e.tokens);
    $("pf-time").textContent = e.seconds === null || e.seconds === undefined ? "unknown" : "~" + fmtDuration(e.seconds);
    $("pf-cost").textContent = e.cost_usd === null || e.cost_usd === undefined ? "unknown" : "~" + fmtUSD(e.cost_usd);
    $("pf-note").textContent = e.seconds === null || e.seconds === undefined
      ? "Time and cost need the dataset's token count."
      : "Rough: ~4 FLOPs per base parameter per token at 40% MFU; compile time not included.";
  }

  // ---------- side info ----------
  function renderModelInfo() {
    const opt = modelSelect.selectedOptions[0];
    const info = $("base-model-info");
    if (!opt) { info.textContent = ""; return; }
    info.replaceChildren(
      opt.dataset.description || "",
      el("span", { className: "faint" }, " · " + fmtCompact(Number(opt.dataset.params)) + " parameters"
        + (opt.dataset.preset !== opt.value ? " · preset " + opt.dataset.preset : "")),
      el("div", { className: "faint mono" }, opt.dataset.source),
    );
    renderModelName();
  }

  function renderPoolInfo() {
    const opt = poolSelect.selectedOptions[0];
    const info = $("pool-info");
    if (!opt || !opt.value) { info.textContent = ""; return; }
    const online = Number(opt.dataset.online);
    const chips = Number(opt.dataset.chips);
    info.replaceChildren(
      el("span", {}, el("b", {}, String(chips)), chips === 1 ? " chip" : " chips"),
      el("span", {}, el("b", {}, "$" + Number(opt.dataset.price).toFixed(2)), " / chip-hour"),
      el("span", { className: online ? "" : "warn-text" },
        el("span", { className: "dot" + (online ? " on" : ""), "aria-hidden": "true" }),
        online ? online + (online === 1 ? " host online" : " hosts online") : "no hosts online: the run will wait in the queue"),
    );
  }

  function renderModelName() {
    $("model-name-preview").textContent = "ft:" + modelSelect.value + ":" + ($("suffix").value.trim() || "tunedeck") + ":run-…";
  }

  function syncLength() {
    const steps = form.querySelector('[data-config="max_steps"]').value.trim();
    const epochs = form.querySelector('[data-config="epochs"]');
    epochs.disabled = steps !== "";
    epochs.closest(".field").classList.toggle("dimmed", steps !== "");
    epochs.title = steps !== "" ? "Ignored: max steps is set" : "";
  }

  // Quick picks for the target modules.
  const GROUPS = {
    all: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    attn: ["q_proj", "k_proj", "v_proj", "o_proj"],
    mlp: ["gate_proj", "up_proj", "down_proj"],
  };
  form.querySelectorAll("[data-modules]").forEach((button) => {
    button.addEventListener("click", () => {
      const want = GROUPS[button.dataset.modules];
      form.querySelectorAll('[data-config="target_modules"]').forEach((box) => { box.checked = want.includes(box.value); });
      scheduleEstimate();
    });
  });

  // ---------- datasets: the demo import, and a ?dataset= that is still validating ----------
  function optionText(d) {
    const parts = [d.filename];
    if (d.status === "validating") return d.filename + " (validating…)";
    if (d.rows !== null && d.rows !== undefined) parts.push(fmtNum(d.rows) + " rows");
    if (d.format) parts.push(d.format);
    return parts.join(" · ");
  }

  function upsertOption(select, d, { disabled } = {}) {
    let opt = [...select.options].find((o) => o.value === d.id);
    if (!opt) {
      opt = el("option", { value: d.id });
      const first = select === validationSelect ? select.options[1] : select.options[0];
      select.insertBefore(opt, first || null); // newest first, as on the datasets page
    }
    opt.textContent = optionText(d);
    opt.disabled = !!disabled;
    return opt;
  }

  function addDataset(d, { select } = {}) {
    datasetSelect.querySelectorAll("option.no-datasets").forEach((o) => o.remove());
    const pending = d.status !== "ready";
    upsertOption(datasetSelect, d, { disabled: pending });
    upsertOption(validationSelect, d, { disabled: pending });
    if (select && !pending) {
      datasetSelect.value = d.id;
      datasetSelect.dispatchEvent(new Event("change", { bubbles: true }));
    }
  }

  function setDemoStatus(text, kind, link) {
    demoStatus.className = "hint" + (kind ? " " + kind : "");
    demoStatus.replaceChildren(text, link || "");
  }

  async function waitReady(id, onProgress) {
    const deadline = Date.now() + 5 * 60 * 1000;
    for (;;) {
      const d = await api("/api/v1/datasets/" + encodeURIComponent(id));
      if (d.status !== "validating") return d;
      if (onProgress) onProgress(d);
      if (Date.now() > deadline) throw new Error("validation is taking too long; see the dataset page");
      await new Promise((r) => setTimeout(r, 800));
    }
  }

  async function follow(d) {
    const link = el("a", { href: "/datasets/" + encodeURIComponent(d.id) }, "view report");
    if (d.status === "validating") {
      addDataset(d);
      setDemoStatus("Validating " + d.filename + "… ", "busy", link);
      d = await waitReady(d.id, (cur) => {
        const pct = cur.bytes ? Math.floor((100 * (cur.progress_bytes || 0)) / cur.bytes) : 0;
        setDemoStatus("Validating " + cur.filename + "… " + pct + "% ", "busy", link);
      });
    }
    if (d.status === "ready") {
      addDataset(d, { select: true });
      setDemoStatus("Ready: " + d.filename + " (" + fmtNum(d.rows) + " rows) is selected. ", "ok", link);
    } else {
      [datasetSelect, validationSelect].forEach((s) => { const o = [...s.options].find((x) => x.value === d.id); if (o) o.remove(); });
      setDemoStatus(d.filename + " is " + d.status + " and cannot be used. ", "bad", link);
    }
    return d;
  }

  demoButton.addEventListener("click", async () => {
    demoButton.disabled = true;
    setDemoStatus("Importing the demo dataset…", "busy");
    try {
      const d = await api("/api/v1/datasets/demo", { method: "POST" });
      await follow(d);
    } catch (err) {
      const text = err.status === 404 || err.status === 405
        ? "This server cannot import the demo dataset (HTTP " + err.status + ")."
        : "Demo import failed: " + err.message;
      setDemoStatus(text, "bad");
    } finally {
      demoButton.disabled = false;
    }
  });

  async function preselect() {
    const wanted = JSON.parse($("selected-dataset").textContent);
    if (!wanted || [...datasetSelect.options].some((o) => o.value === wanted)) return;
    try {
      await follow(await api("/api/v1/datasets/" + encodeURIComponent(wanted)));
    } catch (err) {
      setDemoStatus(err.status === 404 ? "Dataset " + wanted + " was not found." : "Dataset " + wanted + ": " + err.message, "bad");
    }
  }

  // ---------- submit ----------
  let submitting = false;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (submitting) return;
    submitting = true;
    launch.disabled = true;
    launch.textContent = "Launching…";
    clearTimeout(estimateTimer);
    estimateSeq++; // an estimate still in flight must not clear the errors we are about to show
    clearErrors();
    try {
      const run = await api("/api/v1/runs", { method: "POST", json: body() });
      launch.textContent = "Launched · opening…";
      window.location.assign("/runs/" + encodeURIComponent(run.id));
      return;
    } catch (err) {
      if (err.status === 422 && err.body && Array.isArray(err.body.detail)) {
        showErrors(err.body.detail, { scroll: true });
        $("pf-error").textContent = "Fix the highlighted settings to see an estimate.";
        $("pf-error").hidden = false;
        $("pf-body").classList.add("stale");
      } else {
        $("form-error").textContent = "Could not launch the run: " + err.message;
        $("form-error").hidden = false;
        $("form-error").scrollIntoView({ behavior: "smooth", block: "center" });
      }
    }
    submitting = false;
    launch.disabled = false;
    launch.textContent = "Launch run";
  });

  // ---------- wiring ----------
  form.addEventListener("input", (e) => {
    if (e.target.dataset.config === "max_steps") syncLength();
    if (e.target.id === "suffix") renderModelName();
    scheduleEstimate();
  });
  form.addEventListener("change", (e) => {
    if (e.target === modelSelect) renderModelInfo();
    if (e.target === poolSelect) renderPoolInfo();
    scheduleEstimate();
  });

  renderModelInfo();
  renderPoolInfo();
  syncLength();
  preselect();
  runEstimate();
})();
