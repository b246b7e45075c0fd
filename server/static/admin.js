// The adapters tab: what is resident (GET /v1/adapters) and what was evicted to keep within the
// budget (GET /v1/adapter_root), with the memory each holds; mount (POST) and unmount (DELETE);
// a 401 (no admin key) or 403 (an inference key) asks for the admin key and then retries.

import {call} from "./api.js";
import {$} from "./ui.js";

function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

function cell(row, text, title) {
  const td = row.appendChild(document.createElement("td"));
  td.textContent = text;
  if (title) td.title = title;
  return td;
}

export function initAdmin(page) {
  const rows = $("adapter-table").querySelector("tbody");
  const evictedRows = $("evicted-table").querySelector("tbody");
  const message = $("admin-message");
  const form = $("mount-form");

  function say(text, state) {
    message.textContent = text;
    message.dataset.state = state;
  }

  function failed(error, retry) {
    if (error.status === 401 || error.status === 403) {
      say("", "");
      page.askKey("admin", error.message, retry);
    } else {
      say(error.message, "error");
    }
  }

  function row(card) {
    const tr = document.createElement("tr");
    tr.dataset.id = card.id;
    cell(tr, card.id);
    cell(tr, String(card.rank), `scale ${card.scale}${card.rslora ? ", rsLoRA" : ""}`);
    cell(tr, size(card.size_bytes), `${card.size_bytes} bytes on disk`);
    cell(tr, card.revision.slice(0, 12), card.revision);
    cell(tr, String(card.in_use), "requests running with it");
    const kind = card.pinned ? "pinned" : card.on_demand ? "mounted on first use" : "";
    cell(tr, size(card.ram_bytes) + (card.pinned ? " (pinned)" : ""), kind);
    cell(tr, card.path).className = "path";
    unmountButton(tr, card.id);
    return tr;
  }

  function unmountButton(tr, id) {
    const button = cell(tr, "").appendChild(document.createElement("button"));
    button.type = "button";
    button.className = "unmount";
    button.textContent = "Unmount";
    button.addEventListener("click", () => unmount(id));
  }

  function evictedRow(entry) {
    const tr = document.createElement("tr");
    tr.dataset.id = entry.id;
    cell(tr, entry.id);
    cell(tr, entry.size_bytes === null ? "" : size(entry.size_bytes), "on disk");
    cell(tr, size(entry.ram_bytes), "mounted again on its next request");
    cell(tr, entry.path).className = "path";
    unmountButton(tr, entry.id);
    return tr;
  }

  function budget(listing) {
    const bounds = [];
    const most = listing.max_mounted_adapters;
    if (most !== null) bounds.push(`${most} adapter${most === 1 ? "" : "s"}`);
    if (listing.adapter_memory_bytes !== null) bounds.push(size(listing.adapter_memory_bytes));
    const limit = bounds.length ? ` of at most ${bounds.join(" and ")}` : "";
    const lazy = listing.auto_mount ? "; requests mount adapters under the root on first use" : "";
    return `Resident: ${size(listing.resident_bytes)}${limit}${lazy}.`;
  }

  async function load() {
    try {
      const {data} = await call("admin", "GET", "v1/adapters");
      rows.replaceChildren(...data.data.map(row));
      $("adapter-empty").hidden = data.data.length > 0;
      const root = (await call("admin", "GET", "v1/adapter_root")).data;
      const evicted = root.data.filter((entry) => entry.state === "evicted");
      evictedRows.replaceChildren(...evicted.map(evictedRow));
      $("evicted-empty").hidden = evicted.length > 0;
      $("adapter-budget").textContent = budget(root);
    } catch (error) {
      failed(error, load);
    }
  }

  async function changed() {
    await load();
    await page.refreshModels();
  }

  async function unmount(id) {
    try {
      await call("admin", "DELETE", `v1/adapters/${encodeURIComponent(id)}`);
    } catch (error) {
      failed(error, () => unmount(id));
      return;
    }
    say(`Unmounted ${id}.`, "ok");
    await changed();
  }

  async function mount() {
    const fields = {
      id: form.elements.id.value.trim(),
      path: form.elements.path.value.trim(),
      replace: form.elements.replace.checked,
      pin: form.elements.pin.checked,
    };
    let answer;
    try {
      answer = await call("admin", "POST", "v1/adapters", fields);
    } catch (error) {
      failed(error, mount);
      return;
    }
    const card = answer.data;
    say(
      answer.status === 201
        ? `Mounted ${card.id}: rank ${card.rank}, revision ${card.revision.slice(0, 12)}.`
        : `${card.id} was already mounted from these files.`,
      "ok",
    );
    form.reset();
    await changed();
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    mount();
  });
  $("admin-refresh").addEventListener("click", load);
  page.onShow.admin = load;
}
