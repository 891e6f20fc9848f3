// The page's entry point: the model picker (from /v1/models), the API-key prompt (when the
// server answers 401), the chat and the dashboard.

import {apiFetch, hasKey, setKey} from "./api.js";
import {initChat} from "./chat.js";
import {startDashboard} from "./dashboard.js";

const $ = id => document.getElementById(id);
const RETRY_MS = 2000;

// message: why the key in use failed ("" when none was given yet).
function askForKey(message = "") {
  $("key-error").textContent = message;
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModels() {
  try {
    const models = (await (await apiFetch("/v1/models")).json()).data;
    const picked = $("model").value;
    $("model").replaceChildren(...models.map(m => new Option(m.id, m.id)));
    if (models.some(m => m.id === picked)) $("model").value = picked;
    $("key-form").hidden = true;
  } catch (e) {
    if (e.status === 401) askForKey(hasKey() ? `the server refused the key: ${e.message}` : "");
    else setTimeout(loadModels, RETRY_MS);  // 503 while the engine starts
  }
}

$("key-form").addEventListener("submit", e => {
  e.preventDefault();
  setKey($("api-key").value);
  loadModels();
});

initChat(() => $("model").value, () => askForKey("the server refused the key"));
startDashboard((text, ok) => {
  $("engine-status").textContent = text;
  $("engine-status").classList.toggle("ok", ok);
});
loadModels();
