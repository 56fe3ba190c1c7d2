// The web view's few behaviours: live refresh, the signal forms made from a wait's JSON
// Schema, and the actions (sent with the token as a Bearer header, never as a cookie).
"use strict";

const tokenInput = document.getElementById("token");
if (tokenInput) {
  tokenInput.value = sessionStorage.getItem("wf-token") || "";
  tokenInput.addEventListener("change", () => sessionStorage.setItem("wf-token", tokenInput.value));
}

function text(value) {
  return value === null || value === undefined ? "" : String(value);
}

function cell(row, value, className) {
  const td = document.createElement("td");
  if (className) {
    const span = document.createElement("span");
    span.className = className;
    span.textContent = text(value);
    td.appendChild(span);
  } else {
    td.textContent = text(value);
  }
  row.appendChild(td);
  return td;
}

// The runs list: the same query against the JSON API every 2 s while "live" is ticked.
const runs = document.querySelector("#runs tbody");
const live = document.getElementById("live");
if (runs && live) {
  let busy = false; // one request at a time: a slow answer is not asked for again meanwhile
  setInterval(async () => {
    if (!live.checked || busy) return;
    busy = true;
    let page;
    try {
      const response = await fetch("/api/runs" + window.location.search);
      if (!response.ok) return;
      page = await response.json();
    } catch (error) {
      return;
    } finally {
      busy = false;
    }
    const body = document.createElement("tbody");
    for (const r of page.runs) {
      const row = document.createElement("tr");
      row.className = "run";
      row.dataset.id = r.id;
      const link = document.createElement("a");
      link.href = "/runs/" + encodeURIComponent(r.id);
      link.textContent = r.id;
      cell(row, "").appendChild(link);
      cell(row, r.workflow);
      cell(row, r.version);
      cell(row, r.status, "status " + r.status);
      cell(row, r.actor);
      cell(row, r.createdAt);
      cell(row, r.finishedAt);
      body.appendChild(row);
    }
    if (!page.runs.length) {
      const row = document.createElement("tr");
      row.className = "empty";
      cell(row, "No runs.").colSpan = 7;
      body.appendChild(row);
    }
    runs.replaceChildren(...body.children);
  }, 2000);
}

// A run's page: reloaded when the run moved on (status or timeline), until it ended.
const facts = document.querySelector("dl.facts");
const status = document.getElementById("status");
if (facts && status && !["completed", "failed"].includes(status.textContent)) {
  const seen = document.querySelectorAll("#timeline li").length;
  let busy = false; // a long run's page may take a while: never two requests at once
  const timer = setInterval(async () => {
    if (busy || (document.activeElement && document.activeElement.closest("form"))) return;
    busy = true;
    let found;
    try {
      const response = await fetch("/api/runs/" + encodeURIComponent(facts.dataset.run));
      if (!response.ok) return;
      found = await response.json();
    } catch (error) {
      return;
    } finally {
      busy = false;
    }
    if (found.run.status !== status.textContent || found.timeline.length !== seen) {
      clearInterval(timer);
      window.location.reload();
    }
  }, 1500);
}

async function act(path, body) {
  const shown = document.getElementById("action-result");
  const response = await fetch(path, {
    method: "POST",
    headers: {
      "Content-Type": "application/json",
      "Authorization": "Bearer " + (tokenInput ? tokenInput.value : ""),
    },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  if (shown) shown.textContent = response.ok ? "done" : "refused: " + answer.error;
  return [response.ok, answer];
}

// One input per property of an object schema (text, number, checkbox), else one JSON box.
// A field starts at its default (a constant's value), so a form left as it is sends them.
function field(container, name, given) {
  // A schema may be true or false (anything, nothing): no type, no default to go by.
  const schema = given !== null && typeof given === "object" ? given : {};
  const label = document.createElement("label");
  label.textContent = name + " ";
  const type = schema.type;
  const preset = "default" in schema ? schema.default : schema.const;
  let input;
  if (type === "boolean") {
    input = document.createElement("input");
    input.type = "checkbox";
    input.checked = preset === true;
  } else if (type === "integer" || type === "number") {
    input = document.createElement("input");
    input.type = "number";
    if (type === "number") input.step = "any";
    if (typeof preset === "number") input.value = String(preset);
  } else if (type === "string") {
    const lines = typeof preset === "string" && /[\r\n]/.test(preset);
    input = document.createElement(lines ? "textarea" : "input"); // a text box drops line breaks
    if (!lines) input.type = "text";
    if (typeof preset === "string") input.value = preset;
  } else {
    input = document.createElement("textarea");
    input.placeholder = "JSON";
    if (preset !== undefined) input.value = JSON.stringify(preset);
  }
  input.name = name;
  input.dataset.kind = type === "boolean" || type === "integer" || type === "number" || type === "string" ? type : "json";
  label.appendChild(input);
  container.appendChild(label);
}

function read(input) {
  const kind = input.dataset.kind;
  if (kind === "boolean") return input.checked;
  if (kind === "integer" || kind === "number") return input.value === "" ? null : Number(input.value);
  if (kind === "string") return input.value;
  return input.value.trim() === "" ? null : JSON.parse(input.value);
}

for (const form of document.querySelectorAll("form.signal-form")) {
  const schema = JSON.parse(form.querySelector(".schema-data").textContent || "null") || {};
  const fields = form.querySelector(".fields");
  const object = schema.type === "object" && schema.properties;
  if (object) {
    for (const [name, sub] of Object.entries(schema.properties)) field(fields, name, sub);
  } else {
    field(fields, "payload", schema);
  }
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    let payload;
    try {
      if (object) {
        payload = {};
        for (const input of fields.querySelectorAll("input, textarea")) payload[input.name] = read(input);
      } else {
        payload = read(fields.querySelector("input, textarea"));
      }
    } catch (error) {
      document.getElementById("action-result").textContent = "not JSON: " + error.message;
      return;
    }
    const [ok] = await act("/api/runs/" + encodeURIComponent(facts.dataset.run) + "/signal", {
      name: form.dataset.name,
      payload,
    });
    if (ok) setTimeout(() => window.location.reload(), 300);
  });
}

for (const [id, body] of [["cancel", {}], ["end-now", { compensate: false }]]) {
  const button = document.getElementById(id);
  if (button) {
    button.addEventListener("click", async () => {
      const [ok] = await act("/api/runs/" + encodeURIComponent(facts.dataset.run) + "/cancel", body);
      if (ok) setTimeout(() => window.location.reload(), 300);
    });
  }
}
const retry = document.getElementById("retry");
if (retry) {
  retry.addEventListener("click", async () => {
    const [ok, answer] = await act("/api/runs/" + encodeURIComponent(facts.dataset.run) + "/retry", {});
    if (ok) window.location.href = "/runs/" + encodeURIComponent(answer.id);
  });
}
