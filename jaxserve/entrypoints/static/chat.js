// The chat playground: a conversation streamed from /v1/chat/completions with the settings'
// sampling fields and JSON schema, each reply's token counts, time to first token and speed,
// and a stop button that aborts the request (the server then aborts it in the engine).

import {APIError, apiFetch, readEvents} from "./api.js";

const $ = id => document.getElementById(id);
let history = [];  // the conversation so far, without the system prompt
let controller = null;  // the AbortController of the reply streaming now

function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  li.append(content);
  $("messages").append(li);
  return li;
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);  // undefined: left out, the model's default applies
}

// The request body from the settings; throws an Error for a schema that is not JSON.
function requestBody(model) {
  const system = $("system").value.trim();
  const body = {
    model,
    messages: [...(system ? [{role: "system", content: system}] : []), ...history],
    stream: true,
    stream_options: {include_usage: true},
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
  };
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (e) {
      throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
    }
    body.response_format = {type: "json_schema",
                            json_schema: {name: $("schema-name").value.trim() || "reply", schema: parsed}};
  }
  return body;
}

// The reply's numbers, in its footer and (raw, for tools and tests) in its data attributes.
// Times are performance.now() milliseconds; tokens from the usage chunk, or the chunks
// received when the reply was stopped (one token each, but for multi-byte characters).
function showStats(li, {start, first, last, usage, chunks}) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const parts = [usage ? `${usage.prompt_tokens} prompt + ${tokens} completion tokens`
                       : `≈${tokens} tokens`];
  if (first !== null) {
    li.dataset.ttftS = ((first - start) / 1000).toFixed(3);
    parts.push(`TTFT ${li.dataset.ttftS} s`);
  }
  if (tokens > 1 && last > first) {
    // Decode speed: the tokens after the first over the time after the first.
    li.dataset.tokensPerS = ((tokens - 1) / ((last - first) / 1000)).toFixed(1);
    parts.push(`${li.dataset.tokensPerS} tok/s`);
  }
  const footer = document.createElement("div");
  footer.className = "stats";
  footer.textContent = parts.join(" · ");
  li.append(footer);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showError(message) {
  $("chat-error").textContent = message;
}

// Sends the composer's text with the conversation; onUnauthorized() is called on a 401.
async function send(model, onUnauthorized) {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  showError("");
  // Clear may start a new conversation while this reply streams: the reply stays in its own.
  const conversation = history;
  conversation.push({role: "user", content: text});
  let body;
  try {
    if (!model) {
      throw new Error($("key-form").hidden ? "no model yet: the engine is starting"
                                           : "no model yet: the server needs its API key");
    }
    body = requestBody(model);
  } catch (e) {
    conversation.pop();
    showError(e.message);
    return;
  }
  $("prompt").value = "";
  addMessage("user", text);
  const li = addMessage("assistant", "");
  const content = li.querySelector(".content");
  li.dataset.state = "streaming";
  li.dataset.chunks = "0";
  li.scrollIntoView({block: "end"});
  controller = new AbortController();
  setBusy(true);
  const stats = {start: performance.now(), first: null, last: null, usage: null, chunks: 0};
  try {
    const resp = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body), signal: controller.signal});
    await readEvents(resp, event => {
      if (event.error) throw new APIError(500, event.error.message);
      if (event.usage) stats.usage = event.usage;
      // The last chunk with a choice (the finish chunk too: an EOS token has no text) ends
      // the reply's time; the first with text starts it.
      if (event.choices?.length) stats.last = performance.now();
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        stats.first ??= stats.last;
        content.textContent += delta;
        li.dataset.chunks = ++stats.chunks;
        li.scrollIntoView({block: "end"});
      }
    });
    li.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      li.dataset.state = "stopped";
    } else {
      controller.abort();  // an error event: end the stream too
      li.dataset.state = "error";
      showError(e.message);
      if (e.status === 401) onUnauthorized();
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (content.textContent) {
    conversation.push({role: "assistant", content: content.textContent});
  } else {
    conversation.pop();  // nothing came back: the next message does not follow this one
  }
  showStats(li, stats);
}

// Wires the composer; model() gives the model picked now.
export function initChat(model, onUnauthorized) {
  $("composer").addEventListener("submit", e => {
    e.preventDefault();
    send(model(), onUnauthorized);
  });
  $("prompt").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => {
    controller?.abort();
    history = [];
    $("messages").replaceChildren();
    showError("");
  });
}
