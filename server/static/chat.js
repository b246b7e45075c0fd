// The chat tab: one conversation, each answer streamed under the adapter set chosen for it.

import {answerView, streamAnswer} from "./answer.js";
import {$, followEnd, submitOnEnter} from "./ui.js";

export function initChat(page) {
  const log = $("chat-log");
  const input = $("chat-input");
  const adapter = $("chat-adapter");
  let messages = [];
  let controller = null;

  function add(className, text) {
    const el = log.appendChild(document.createElement("article"));
    el.className = className;
    el.textContent = text;
    return el;
  }

  function busy(running) {
    $("chat-send").disabled = running;
    $("chat-stop").disabled = !running;
  }

  async function ask(content) {
    const turn = [...messages, {role: "user", content}];
    let body;
    try {
      body = page.chatBody(turn, adapter.value);
    } catch (error) {
      add("notice", error.message);
      return;
    }
    input.value = "";
    add("question", content);
    const view = answerView(page.label(adapter.value));
    log.appendChild(view.el);
    controller = new AbortController();
    busy(true);
    try {
      const answer = await streamAnswer(body, view, controller.signal);
      messages = [...turn, {role: "assistant", content: answer}];
    } catch (error) {
      // The failed turn stays on screen but out of the conversation sent next time.
      if (error.status === 401) page.askKey("inference", error.message, page.refreshModels);
    } finally {
      controller = null;
      busy(false);
    }
  }

  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const content = input.value.trim();
    if (content && !controller) ask(content);
  });
  $("chat-stop").addEventListener("click", () => controller && controller.abort());
  $("chat-new").addEventListener("click", () => {
    if (controller) controller.abort();
    messages = [];
    log.replaceChildren();
    input.focus();
  });
  submitOnEnter(input);
  followEnd(log);
}
