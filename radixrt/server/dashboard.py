"""`GET /dashboard`: one page that watches the cache live. Plain HTML and a little JavaScript.

No build step and nothing fetched from elsewhere, so it works offline and
behind any proxy. Every few seconds the page reads `/get_server_info`
(counters, running and queued requests) and `/cache/tree.svg` (the tree's
picture), and keeps the hit rate and pool usage of the last minutes to draw
them as a line chart. When the server needs an API key, the page asks for one
and keeps it in the tab's sessionStorage only.
"""

from __future__ import annotations

REFRESH_S = 2
HISTORY_POINTS = 150  # five minutes at one point per refresh

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>radixrt cache</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 16px; color: #111827; }
  h1 { font-size: 18px; margin: 0 0 12px; }
  .counters { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 12px; }
  .counter { border: 1px solid #d1d5db; border-radius: 6px; padding: 8px 12px; min-width: 120px; }
  .counter b { display: block; font-size: 20px; }
  #history { border: 1px solid #d1d5db; border-radius: 6px; }
  #tree { overflow: auto; border: 1px solid #d1d5db; border-radius: 6px; margin-top: 12px; max-height: 70vh; }
  #status { color: #6b7280; margin-left: 8px; }
  #key-form { display: none; margin-bottom: 12px; }
</style>
</head>
<body>
<h1>radixrt cache <span id="status">connecting...</span></h1>
<form id="key-form">This server needs an API key:
  <input id="api-key" type="password" size="40" autocomplete="off"> <button type="submit">use</button>
</form>
<div class="counters">
  <div class="counter">hit rate<b id="hit-rate">-</b></div>
  <div class="counter">prompt tokens<b id="prompt-tokens">-</b></div>
  <div class="counter">cached prompt tokens<b id="cached-tokens">-</b></div>
  <div class="counter">KV pool used<b id="token-usage">-</b></div>
  <div class="counter">running<b id="running">-</b></div>
  <div class="counter">queued<b id="queued">-</b></div>
  <div class="counter">tree tokens<b id="tree-tokens">-</b></div>
</div>
<svg id="history" width="640" height="140" viewBox="0 0 640 140">
  <text x="8" y="16" font-size="12" fill="#2563eb">hit rate</text>
  <text x="80" y="16" font-size="12" fill="#f59e0b">KV pool used</text>
  <text x="604" y="30" font-size="10" fill="#6b7280">100%</text>
  <text x="620" y="128" font-size="10" fill="#6b7280">0%</text>
  <line x1="0" y1="25" x2="640" y2="25" stroke="#e5e7eb"/>
  <line x1="0" y1="130" x2="640" y2="130" stroke="#e5e7eb"/>
  <polyline id="hit-line" fill="none" stroke="#2563eb" stroke-width="2" points=""/>
  <polyline id="usage-line" fill="none" stroke="#f59e0b" stroke-width="2" points=""/>
</svg>
<div id="tree"></div>
<script>
const REFRESH_MS = __REFRESH_MS__, HISTORY_POINTS = __HISTORY_POINTS__;
const history = [];
let key = sessionStorage.getItem("radixrt-api-key") || "";

function headers() { return key ? {"Authorization": "Bearer " + key} : {}; }

async function get(path) {
  const response = await fetch(path, {headers: headers(), cache: "no-store"});
  if (response.status === 401) {
    document.getElementById("key-form").style.display = "block";
    throw new Error("an API key is needed");
  }
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response;
}

function percent(x) { return (100 * x).toFixed(1) + "%"; }

function line(id, values) {
  const step = 640 / Math.max(HISTORY_POINTS - 1, 1);
  const points = values.map((v, i) => (i * step).toFixed(1) + "," + (130 - 105 * v).toFixed(1));
  document.getElementById(id).setAttribute("points", points.join(" "));
}

function show(stats) {
  const usage = stats.pool_total_tokens ? stats.pool_used_tokens / stats.pool_total_tokens : 0;
  document.getElementById("hit-rate").textContent = percent(stats.hit_rate);
  document.getElementById("prompt-tokens").textContent = stats.prompt_tokens;
  document.getElementById("cached-tokens").textContent = stats.cached_prompt_tokens;
  document.getElementById("token-usage").textContent = percent(usage);
  document.getElementById("running").textContent = stats.running_requests;
  document.getElementById("queued").textContent = stats.waiting_requests;
  document.getElementById("tree-tokens").textContent = stats.tree_tokens;
  history.push({hit: stats.hit_rate, usage: usage});
  if (history.length > HISTORY_POINTS) history.shift();
  line("hit-line", history.map(p => p.hit));
  line("usage-line", history.map(p => p.usage));
}

async function refresh() {
  try {
    const info = await (await get("/get_server_info")).json();
    show(info.cache_stats);
    document.getElementById("tree").innerHTML = await (await get("/cache/tree.svg")).text();
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    document.getElementById("status").textContent = String(error.message || error);
  }
}

document.getElementById("key-form").addEventListener("submit", event => {
  event.preventDefault();
  key = document.getElementById("api-key").value.trim();
  sessionStorage.setItem("radixrt-api-key", key);
  document.getElementById("key-form").style.display = "none";
  refresh();
});
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
""".replace("__REFRESH_MS__", str(REFRESH_S * 1000)).replace("__HISTORY_POINTS__", str(HISTORY_POINTS))
