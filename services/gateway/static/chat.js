// Skiff's chat page: streams /v1/chat/completions (server-sent events) into the conversation,
// with a stop button, the served model's name, sampling settings and the answer's tokens/s.
// No build step and nothing from outside the server: this file is the whole client.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null };

function setStatus(text, kind) {
  $("status").textContent = text;
  $("status").dataset.state = kind;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    $("model").textContent = "";
    setStatus(await errorText(response), "error");
    return;
  }
  const models = (await response.json()).data || [];
  $("model").textContent = models.length ? models[0].id : "no model";
  if ($("status").dataset.state === "error") setStatus("", "idle");
}

function body() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  return {
    model: $("model").textContent,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
}

// Server-sent events: "data: {json}" lines, blank-line separated, "data: [DONE]" last.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("…", "running");
  const started = performance.now();
  let first = null, last = null, tokens = 0, usage = null, finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body()),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const piece = choice.delta?.content || "";
      if (piece) {
        const now = performance.now();
        first = first ?? now;
        last = now;
        tokens += 1;
        answer.textContent += piece;
        answer.scrollIntoView({ block: "end" });
      }
      finish = choice.finish_reason || finish;
    }
    const n = usage ? usage.completion_tokens : tokens;
    const rate = first !== null && last > first ? ((n - 1) * 1000) / (last - first) : 0;
    const ttft = first !== null ? ((first - started) / 1000).toFixed(2) : "–";
    setStatus(`${n} tokens, ${rate.toFixed(1)} tok/s, first token ${ttft} s` +
              (finish && finish !== "stop" ? ` (${finish})` : ""), "done");
  } catch (err) {
    if (err.name === "AbortError") {
      setStatus("stopped", "done");
    } else {
      bubble("error", String(err.message || err));
      setStatus("error", "error");
    }
  } finally {
    state.messages.push({ role: "assistant", content: answer.textContent });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("messages").replaceChildren();
  setStatus("", "idle");
});
for (const id of ["system", "temperature", "top_p", "max_tokens", "api_key"]) {
  const saved = localStorage.getItem(`skiff.${id}`);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => {
    localStorage.setItem(`skiff.${id}`, $(id).value);
    if (id === "api_key") loadModel();
  });
}
loadModel();
