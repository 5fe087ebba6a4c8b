/* Datasets page: drag-and-drop / file-picker upload with a real progress bar, and a live table. */
(function () {
  "use strict";
  const { el, watch, statusPill, fmtNum, fmtBytes, fmtMB, fmtDate, errorMessage, csrfToken } = window.TD;

  const $ = (id) => document.getElementById(id);
  const dropzone = $("dropzone");
  const input = $("file-input");
  const statusBox = $("upload-status");
  const bar = $("upload-progress-bar");
  const progress = $("upload-progress");
  const errorBox = $("upload-error");
  let busy = false;

  // ---------- upload ----------
  function setProgress(loaded, total) {
    const pct = total ? Math.min(100, Math.round((loaded / total) * 100)) : 0;
    bar.style.width = pct + "%";
    progress.setAttribute("aria-valuenow", String(pct));
    $("upload-percent").textContent = pct + "%";
    $("upload-bytes").textContent = fmtMB(loaded) + " / " + fmtMB(total);
  }

  function fail(message) {
    busy = false;
    dropzone.classList.remove("busy");
    progress.classList.remove("striped");
    $("upload-state").textContent = "Failed";
    errorBox.textContent = message;
    errorBox.hidden = false;
  }

  function upload(file) {
    if (!file || busy) return;
    busy = true;
    errorBox.hidden = true;
    dropzone.classList.add("busy");
    statusBox.hidden = false;
    bar.classList.remove("done");
    progress.classList.add("striped");
    $("upload-name").textContent = file.name;
    $("upload-state").textContent = "Uploading…";
    setProgress(0, file.size);

    const form = new FormData();
    form.append("file", file, file.name);
    const fmt = $("upload-format").value;
    const fileType = $("upload-file-type").value;
    if (fmt !== "auto") form.append("format", fmt);
    if (fileType !== "auto") form.append("file_type", fileType);

    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/api/v1/datasets");
    xhr.setRequestHeader("X-CSRF-Token", csrfToken());
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.onprogress = (e) => setProgress(e.loaded, e.lengthComputable ? e.total : file.size);
    xhr.upload.onload = () => {
      setProgress(file.size, file.size);
      $("upload-state").textContent = "Processing…";
    };
    xhr.onerror = () => fail("Network error: the upload did not reach the server.");
    xhr.onload = () => {
      let body = null;
      try { body = JSON.parse(xhr.responseText); } catch (_) { body = null; }
      if (xhr.status === 201 && body && body.id) {
        setProgress(file.size, file.size);
        progress.classList.remove("striped");
        bar.classList.add("done");
        $("upload-state").textContent = "Uploaded · opening report…";
        setTimeout(() => { window.location.assign("/datasets/" + encodeURIComponent(body.id)); }, 250);
      } else {
        fail(errorMessage(body, "Upload failed (HTTP " + xhr.status + ")"));
      }
    };
    xhr.send(form);
  }

  dropzone.addEventListener("click", (e) => { e.preventDefault(); if (!busy) input.click(); });
  dropzone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); input.click(); }
  });
  input.addEventListener("click", (e) => e.stopPropagation());
  input.addEventListener("change", () => { upload(input.files[0]); input.value = ""; });
  for (const name of ["dragenter", "dragover"]) {
    dropzone.addEventListener(name, (e) => {
      e.preventDefault();
      if (e.dataTransfer) e.dataTransfer.dropEffect = "copy";
      dropzone.classList.add("over");
    });
  }
  dropzone.addEventListener("dragleave", (e) => {
    if (!dropzone.contains(e.relatedTarget)) dropzone.classList.remove("over");
  });
  dropzone.addEventListener("drop", (e) => {
    e.preventDefault();
    dropzone.classList.remove("over");
    const files = e.dataTransfer ? e.dataTransfer.files : null;
    if (!files || !files.length) return;
    upload(files[0]);
  });
  // A file dropped beside the zone should not make the browser navigate to it.
  window.addEventListener("dragover", (e) => e.preventDefault());
  window.addEventListener("drop", (e) => e.preventDefault());

  // ---------- live table ----------
  const tbody = $("datasets-body");

  function row(d) {
    const pill = statusPill(d.status);
    if (d.status === "validating" && d.bytes) {
      pill.textContent = "validating " + Math.floor((100 * d.progress_bytes) / d.bytes) + "%";
    }
    return el("tr", { dataset: { id: d.id } },
      el("td", {},
        el("a", { className: "filename", href: "/datasets/" + encodeURIComponent(d.id) }, d.filename),
        el("div", { className: "small faint mono" }, d.id)),
      el("td", {}, pill),
      el("td", {}, d.format ? el("span", { className: "tag" }, d.format) : el("span", { className: "faint" }, "–")),
      el("td", { className: "num" }, d.rows === null ? el("span", { className: "faint" }, "–") : fmtNum(d.rows)),
      el("td", { className: "num" },
        d.error_count ? el("span", { style: "color:var(--red)" }, fmtNum(d.error_count))
          : d.status === "validating" ? el("span", { className: "faint" }, "–") : "0"),
      el("td", { className: "num nowrap" }, fmtBytes(d.bytes)),
      el("td", { className: "muted" }, el("span", { className: "nowrap" }, fmtDate(d.created_at))),
    );
  }

  function render(list) {
    $("dataset-count").textContent = fmtNum(list.count);
    if (!list.data.length) {
      tbody.replaceChildren(el("tr", { className: "empty" },
        el("td", { colspan: 7 }, "No datasets yet. Drop a file above to get started.")));
      return;
    }
    tbody.replaceChildren(...list.data.map(row));
  }

  watch("/api/v1/datasets?watch=true&limit=200", { update: render }, $("live"));
})();
