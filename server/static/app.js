// The chat page: tabs, the generation settings, the served model and adapters (status line and
// suggestions), and a key prompt whenever the server answers 401.

import {initAb} from "./ab.js";
import {initAdmin} from "./admin.js";
import {call, setKey} from "./api.js";
import {initChat} from "./chat.js";
import {$} from "./ui.js";

const TABS = ["chat", "ab", "admin"];

const page = {
  baseId: null,
  adapterIds: [],
  onShow: {},

  /** A chat request with the page's settings; `spec` is the adapter field's text. */
  chatBody(messages, spec) {
    if (!page.baseId) throw new Error("The server has not said which model it serves yet.");
    const system = $("system-prompt").value.trim();
    const body = {
      model: page.baseId,
      messages: system ? [{role: "system", content: system}, ...messages] : messages,
    };
    const temperature = $("temperature").value;
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("max-tokens").value;
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const adapter = spec.trim();
    if (adapter && adapter !== "none") body.adapter = adapter;
    return body;
  },

  /** What an adapter field's text asks for, in words. */
  label(spec) {
    const adapter = spec.trim();
    return adapter && adapter !== "none" ? adapter : "base model";
  },

  /** Show the key form for `kind` ("inference" or "admin"); `then` runs once a key is given. */
  askKey(kind, message, then) {
    const form = $(kind === "admin" ? "admin-key" : "inference-key");
    form.querySelector(".key-message").textContent = message;
    form.hidden = false;
    form.elements.key.focus();
    form.onsubmit = (event) => {
      event.preventDefault();
      setKey(kind, form.elements.key.value.trim());
      form.elements.key.value = "";
      form.hidden = true;
      then();
    };
  },

  refreshModels,
};

function setStatus(state, text) {
  const status = $("status");
  status.dataset.state = state;
  status.textContent = text;
}

function option(value, label) {
  const el = document.createElement("option");
  el.value = value;
  el.label = label;
  return el;
}

function fillSuggestions() {
  const ids = page.adapterIds;
  const options = [option("none", "the base model alone"), ...ids.map((id) => option(id, "adapter"))];
  if (ids.length >= 2) {
    options.push(option(`${ids[0]}+${ids[1]}`, "a stack: both residuals summed"));
    options.push(option(`${ids[0]}@0.5+${ids[1]}`, "a stack, the first at half its scale"));
  } else if (ids.length === 1) {
    options.push(option(`${ids[0]}@0.5`, "at half its trained scale"));
  }
  $("adapter-options").replaceChildren(...options);
}

async function refreshModels() {
  try {
    const {data} = await call("inference", "GET", "v1/models");
    const base = data.data.find((model) => !model.parent) || data.data[0];
    page.baseId = base.id;
    page.adapterIds = data.data.filter((model) => model.parent).map((model) => model.id);
    fillSuggestions();
    const count = page.adapterIds.length;
    setStatus("ready", `${base.id} · ${count} adapter${count === 1 ? "" : "s"} mounted`);
  } catch (error) {
    if (error.status === 401) {
      setStatus("locked", "API key needed");
      page.askKey("inference", error.message, refreshModels);
    } else if (error.status === 503) {
      setStatus("loading", error.message);
      setTimeout(refreshModels, 2000);
    } else {
      setStatus("error", error.message);
      setTimeout(refreshModels, 5000);
    }
  }
}

function show(name) {
  const tab = TABS.includes(name) ? name : "chat";
  for (const button of document.querySelectorAll("[data-tab]")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
  }
  for (const other of TABS) $(`${other}-panel`).hidden = other !== tab;
  if (page.onShow[tab]) page.onShow[tab]();
}

for (const button of document.querySelectorAll("[data-tab]")) {
  button.addEventListener("click", () => {
    history.replaceState(null, "", `#${button.dataset.tab}`);
    show(button.dataset.tab);
  });
}

initChat(page);
initAb(page);
initAdmin(page);
show(location.hash.slice(1));
refreshModels();
