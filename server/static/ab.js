// The A/B tab: one prompt answered under two adapter sets side by side, both streaming at once.

import {answerView, streamAnswer} from "./answer.js";
import {$, submitOnEnter} from "./ui.js";

const SIDES = [
  {spec: "ab-a", out: "ab-out-a"},
  {spec: "ab-b", out: "ab-out-b"},
];

export function initAb(page) {
  const input = $("ab-input");
  let controller = null;

  function busy(running) {
    $("ab-run").disabled = running;
    $("ab-stop").disabled = !running;
  }

  async function side(prompt, {spec, out}, signal) {
    const text = $(spec).value;
    const view = answerView(page.label(text));
    const question = document.createElement("p");
    question.className = "ab-question";
    question.textContent = prompt;
    $(out).replaceChildren(question, view.el);
    let body;
    try {
      body = page.chatBody([{role: "user", content: prompt}], text);
    } catch (error) {
      view.fail(error.message);
      return;
    }
    try {
      await streamAnswer(body, view, signal);
    } catch (error) {
      if (error.status === 401) page.askKey("inference", error.message, page.refreshModels);
    }
  }

  async function run(prompt) {
    controller = new AbortController();
    busy(true);
    try {
      await Promise.all(SIDES.map((which) => side(prompt, which, controller.signal)));
    } finally {
      controller = null;
      busy(false);
    }
  }

  $("ab-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = input.value.trim();
    if (prompt && !controller) run(prompt);
  });
  $("ab-stop").addEventListener("click", () => controller && controller.abort());
  submitOnEnter(input);
}
