// One streamed answer on the page: its text as it arrives, then the adapter set that served it
// (the response's `model`), its token count and speed.

import {streamChat} from "./api.js";

function part(parent, tag, className, text = "") {
  const el = parent.appendChild(document.createElement(tag));
  el.className = className;
  el.textContent = text;
  return el;
}

/** An empty answer box; `asked` names the adapter set requested, until the server says. */
export function answerView(asked) {
  const el = document.createElement("article");
  el.className = "answer";
  el.dataset.state = "waiting";
  const head = part(el, "header", "answer-head");
  const model = part(head, "span", "answer-model", asked);
  model.title = "adapter set requested";
  const text = part(el, "div", "answer-text");
  const stats = part(el, "div", "answer-stats", "waiting…");
  let chunks = 0;
  let thoughts = null; // a thinking model's reasoning, folded above its answer
  return {
    el,
    think(delta) {
      if (thoughts === null) {
        const fold = document.createElement("details");
        fold.className = "answer-thinking";
        part(fold, "summary", "", "thinking");
        thoughts = part(fold, "div", "answer-thinking-text");
        el.insertBefore(fold, text);
      }
      el.dataset.state = "streaming";
      thoughts.textContent = (thoughts.textContent + delta).trimStart();
      stats.textContent = "thinking…";
    },
    append(delta) {
      el.dataset.state = "streaming";
      el.dataset.chunks = String(++chunks);
      // Shown without the space a token may open the answer with (SentencePiece models'
      // first word); the conversation keeps the answer as the server sent it.
      text.textContent = (text.textContent + delta).trimStart();
      stats.textContent = "streaming…";
    },
    served(name) {
      model.textContent = name;
      model.title = "adapter set served (the response's model)";
      el.dataset.model = name;
    },
    done(summary) {
      el.dataset.state = "done";
      el.dataset.tokens = String(summary.tokens);
      el.dataset.tokensPerSecond = summary.rate.toFixed(2);
      stats.textContent = summary.line;
    },
    fail(message) {
      el.dataset.state = "error";
      stats.textContent = "";
      part(el, "p", "answer-error", message);
    },
  };
}

const FINISH = {stop: "", length: " · cut at max tokens", stopped: " · stopped"};

function summarize(timing, usage, finish) {
  const tokens = usage ? usage.completion_tokens : timing.chunks;
  const end = timing.last ?? performance.now();
  // Decode speed: the tokens after the first, over the time they took to arrive. When they
  // all arrived at once, the whole answer's time instead.
  const decoding = (timing.last - timing.first) / 1000;
  const rate =
    tokens > 1 && decoding > 0 ? (tokens - 1) / decoding : tokens / ((end - timing.started) / 1000);
  const parts = [`${tokens} tokens`, `${rate.toFixed(1)} tok/s`];
  if (timing.first !== null) {
    parts.push(`first token ${((timing.first - timing.started) / 1000).toFixed(2)} s`);
  }
  if (usage) parts.push(`prompt ${usage.prompt_tokens} tokens`);
  return {tokens, rate, line: parts.join(" · ") + (FINISH[finish] ?? ` · ${finish}`)};
}

/** Stream `body` into `view`; resolves to the answer's text (what arrived, if stopped). */
export async function streamAnswer(body, view, signal) {
  const timing = {started: performance.now(), first: null, last: null, chunks: 0};
  let usage = null;
  let finish = "stop";
  let content = "";
  const arrived = () => {
    timing.last = performance.now();
    timing.first ??= timing.last;
  };
  try {
    for await (const chunk of streamChat(body, signal)) {
      if (chunk.model) view.served(chunk.model);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        // A thinking model's reasoning comes first: shown apart, not kept in the conversation
        // (chat templates drop an earlier turn's thinking).
        const thought = choice.delta && choice.delta.reasoning_content;
        if (thought) {
          arrived();
          view.think(thought);
        }
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          arrived();
          timing.chunks += 1;
          content += delta;
          view.append(delta);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      view.fail(error.message);
      throw error;
    }
    finish = "stopped";
  }
  view.done(summarize(timing, usage, finish));
  return content;
}
