-- wrk script for the cost benchmark: POSTs OpenAI chat bodies of about BODY_BYTES bytes.
--
-- Each wrk thread pre-builds TENANTS x QUESTIONS distinct requests at start-up (a tenant's long
-- system prompt plus a short question, as in the cache traces) and cycles through them, so the
-- routers see realistic, partly shared prefixes and the load generator spends no time building
-- bodies while it measures. `done` prints one JSON line (prefixed "WRK_JSON ") for bench.py.
--
-- COLD=1 makes every request a prompt no router has seen: a unique first line ("Request N.")
-- before the tenant's system prompt, so no block of it ever matches (every new conversation,
-- batch job or agent looks like this to a prefix router). Those bodies are built per request.
--
-- COMPLETIONS=1 sends the same text as a completions body (`{"model":…,"prompt":"<system
-- prompt> <question>"}`; point wrk at /v1/completions).
--
-- TEXT_PARTS=1 writes each chat content as a list of one text part (`"content": [{"type":
-- "text", "text": "…"}]`), as some SDKs and frameworks send it.
--
-- LINE_WORDS=N breaks the text into lines of N words: a line break, which JSON escapes as `\n`,
-- every N words (most real prompts: markdown, code, documents). Unset or 0: one line.
--
--   BODY_BYTES=8192 [COLD=1] [LINE_WORDS=12] wrk -t1 -c32 -d10s -s bench/chat.lua http://127.0.0.1:PORT/v1/chat/completions

local body_bytes = tonumber(os.getenv("BODY_BYTES") or "8192")
local tenants = tonumber(os.getenv("TENANTS") or "16")
local questions = tonumber(os.getenv("QUESTIONS") or "4")
local cold = os.getenv("COLD") == "1"
local line_words = tonumber(os.getenv("LINE_WORDS") or "0")
local completions = os.getenv("COMPLETIONS") == "1"
local text_parts = os.getenv("TEXT_PARTS") == "1"

local words = {
  "account", "billing", "cache", "cluster", "customer", "deploy", "gateway", "invoice",
  "ledger", "metric", "network", "order", "policy", "quota", "region", "release", "report",
  "schedule", "service", "shipment", "storage", "tenant", "ticket", "token", "update",
  "workflow", "always", "never", "check", "confirm", "explain", "summarize", "the", "a",
  "of", "to", "and", "for", "with", "each", "every", "your",
}

-- Deterministic text of n bytes as it is written in JSON (a linear congruential generator
-- picks the words), with a line break every LINE_WORDS words.
local function text(seed, n)
  local parts, len, x = {}, 0, seed
  while len < n do
    x = (x * 1103515245 + 12345) % 2147483648
    local w = words[(x % #words) + 1]
    if #parts == 0 then
      parts[1] = w
    elseif line_words > 0 and #parts % line_words == 0 then
      parts[#parts + 1] = "\\n" .. w
      len = len + 1
    else
      parts[#parts + 1] = " " .. w
    end
    len = len + #w + 1
  end
  local s = string.sub(table.concat(parts), 1, n)
  -- Cut inside an escape, the text would escape the quote that closes it.
  if string.sub(s, -1) == "\\" then
    s = string.sub(s, 1, -2)
  end
  return s
end

local requests = {}
local tails = {}
local index = 0
local sent = 0
local head = '{"model":"cc-sim","max_tokens":1,"messages":[{"role":"system","content":"'
-- Between the system prompt and the question, and after the question.
local middle, tail_end = '"},{"role":"user","content":"', '"}]}'
if completions then
  head = '{"model":"cc-sim","max_tokens":1,"prompt":"'
  middle, tail_end = " ", '"}'
elseif text_parts then
  head = '{"model":"cc-sim","max_tokens":1,"messages":[{"role":"system","content":[{"type":"text","text":"'
  middle = '"}]},{"role":"user","content":[{"type":"text","text":"'
  tail_end = '"}]}]}'
end
local headers = { ["Content-Type"] = "application/json" }

function init(args)
  local overhead = 160 -- JSON framing, model name, question
  local system_len = math.max(16, body_bytes - overhead)
  for t = 1, tenants do
    local system = "You are the assistant of tenant " .. t .. ". " .. text(t * 7919, system_len)
    for q = 1, questions do
      local question = text(t * 104729 + q, 48)
      local tail = system .. middle .. question .. tail_end
      tails[#tails + 1] = tail
      requests[#requests + 1] = wrk.format("POST", nil, headers, head .. tail)
    end
  end
  -- Threads start at different offsets so they do not send the same body in lockstep.
  index = math.random(#requests) - 1
end

function request()
  index = (index % #requests) + 1
  if cold then
    sent = sent + 1
    return wrk.format("POST", nil, headers, head .. "Request " .. sent .. ". " .. tails[index])
  end
  return requests[index]
end

function done(summary, latency, requests_)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%.1f,"p90":%.1f,"p99":%.1f,"max":%.1f,"mean":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end
