// Requests to this server: the API key (kept for the browser tab in sessionStorage), OpenAI
// error bodies turned into exceptions, and the SSE stream of a chat completion.

const KEY_ITEM = "jaxserve-api-key";

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function setKey(key) {
  sessionStorage.setItem(KEY_ITEM, key);
}

export function hasKey() {
  return sessionStorage.getItem(KEY_ITEM) !== null;
}

// fetch() with the Authorization header when a key is set; throws APIError on an HTTP error.
export async function apiFetch(path, options = {}) {
  const headers = {...options.headers};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.Authorization = `Bearer ${key}`;
  const resp = await fetch(path, {...options, headers});
  if (!resp.ok) {
    let message = resp.statusText;
    try {
      message = (await resp.json()).error.message;
    } catch {}  // not an OpenAI error body: keep the status text
    throw new APIError(resp.status, message);
  }
  return resp;
}

// Calls onEvent with each SSE event's parsed JSON until "data: [DONE]" or the end of the body.
export async function readEvents(resp, onEvent) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter(l => l.startsWith("data: "))
        .map(l => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) onEvent(JSON.parse(data));
    }
  }
}
