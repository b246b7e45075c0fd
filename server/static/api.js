// Calls to the hotlora API: bearer keys kept for the tab's session, OpenAI-shaped errors, and
// chat completions streamed as server-sent events.

const KEY_NAMES = {inference: "hotlora.apiKey", admin: "hotlora.adminKey"};

export function getKey(kind) {
  return sessionStorage.getItem(KEY_NAMES[kind]) || "";
}

export function setKey(kind, value) {
  if (value) sessionStorage.setItem(KEY_NAMES[kind], value);
  else sessionStorage.removeItem(KEY_NAMES[kind]);
}

/** A non-2xx answer, or an error event in a stream; `message` is the server's own. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(kind, json) {
  const result = json ? {"Content-Type": "application/json"} : {};
  // With no admin key of its own, the server takes the inference key for admin too.
  const key = kind === "admin" ? getKey("admin") || getKey("inference") : getKey("inference");
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // Not JSON: the status line says it.
  }
  return new ApiError(response.status, message);
}

/** One JSON call; `kind` is "inference" or "admin" (which key goes with it). */
export async function call(kind, method, path, body) {
  const init = {method, headers: headers(kind, body !== undefined)};
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return {status: response.status, data: await response.json()};
}

// Events end at a blank line, whichever line ending the server uses.
const EVENT_END = /\r\n\r\n|\n\n|\r\r/;

function eventData(event) {
  const data = [];
  for (const line of event.split(/\r\n|\r|\n/)) {
    if (line.startsWith("data:")) data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return data.length ? data.join("\n") : null;
}

/** Stream a chat completion: yields each chunk object until the server ends the body. */
export async function* streamChat(body, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers("inference", true),
    body: JSON.stringify({...body, stream: true, stream_options: {include_usage: true}}),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(EVENT_END)) >= 0) {
      const data = eventData(buffer.slice(0, end));
      buffer = buffer.slice(end + buffer.slice(end).match(EVENT_END)[0].length);
      // A comment (the server's keep-alive ping), or the last event: the body ends after it,
      // and reading on to that end lets the request finish rather than be cut off.
      if (data === null || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(200, chunk.error.message);
      yield chunk;
    }
  }
}
