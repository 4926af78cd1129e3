//! Synthetic request traces: deterministic from a seed, written as JSONL by the CLI and replayed
//! by the simulator, the load replayer and the web demo.

use rand::Rng;
use rand::SeedableRng;
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;

use prefixroute_core::router::draw_index;

/// One request of a trace: when it is sent (seconds from the start), which group (tenant,
/// conversation, document) it belongs to, and the OpenAI body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    pub t: f64,
    pub group: String,
    pub body: Value,
}

/// What kind of prefix sharing a trace exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceShape {
    /// Tenants, each with its own long system prompt, asking short questions.
    #[default]
    Tenants,
    /// Multi-turn conversations that all start with one shared system prompt and grow by a
    /// question and an answer per turn.
    Conversations,
    /// Retrieval-augmented generation: a few long documents, many questions about each.
    Rag,
    /// Nothing shared: every request is a new prompt of `prompt_words` words (its group is
    /// the request itself), as batch jobs and first messages of new users are.
    Unique,
    /// One gateway carrying two workloads at once: `tenants` tenants asking questions under
    /// their own system prompts and `tenants` conversations sharing one, each request a
    /// tenant's question or a conversation's next turn with even odds.
    Mixed,
}

impl TraceShape {
    pub const ALL: [TraceShape; 5] = [
        TraceShape::Tenants,
        TraceShape::Conversations,
        TraceShape::Rag,
        TraceShape::Unique,
        TraceShape::Mixed,
    ];
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum TraceError {
    #[error("{field} must be {expected}")]
    Invalid {
        field: &'static str,
        expected: &'static str,
    },
    #[error("line {line}: {message}")]
    Parse { line: usize, message: String },
}

/// The writing system of a generated trace's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Script {
    /// English-like words separated by spaces.
    #[default]
    Latin,
    /// The same text in Chinese characters: each word becomes two characters (the same two
    /// for the same word), with no spaces between them and Chinese punctuation, so a
    /// prompt is mostly non-ASCII, as it is for the many users who prompt in Chinese.
    /// Digits, chat roles and JSON stay ASCII.
    Han,
}

/// `text` in Chinese characters (see [`Script::Han`]).
fn han(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if !word.is_empty() {
            // Two characters from the CJK Unified Ideographs block (U+4E00..U+9FFF), picked
            // by the word's hash: the same word is always the same two characters.
            let h = xxhash_rust::xxh64::xxh64(word.as_bytes(), 0);
            for k in 0..2 {
                let code = 0x4e00 + ((h >> (20 * k)) % 0x5200) as u32;
                out.push(char::from_u32(code).unwrap_or('字'));
            }
            word.clear();
        }
    };
    for c in text.chars() {
        if c.is_ascii_alphabetic() {
            word.push(c);
            continue;
        }
        flush(&mut word, &mut out);
        match c {
            '.' => out.push('。'),
            ',' => out.push('，'),
            '?' => out.push('？'),
            ':' => out.push('：'),
            ' ' => {}
            c => out.push(c),
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Parameters of a generated trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TraceSpec {
    pub shape: TraceShape,
    /// Groups: tenants, conversations or documents (`mixed`: as many tenants as
    /// conversations).
    pub tenants: usize,
    pub prompt_words: usize,
    pub question_words: usize,
    /// Mean arrivals per second (Poisson); 0 sends everything back to back at t = 0.
    pub rate: f64,
    pub requests: usize,
    /// Share of traffic for group 0; the rest is spread evenly over the others.
    pub hot: Option<f64>,
    /// Turns after which a conversation ends; its next request starts a new conversation
    /// (a new group under the same shared system prompt). `None`: conversations never end,
    /// so over a long trace every one outgrows any cache; real chats end, and a gateway that
    /// runs for hours sees groups come and go.
    pub turns: Option<usize>,
    pub model: String,
    pub max_tokens: u32,
    /// Bodies ask for a streamed answer (`"stream": true`), so a replay can time each answer's
    /// first token apart from its decoding (see `prefixroute replay`'s `ttft_ms`).
    pub stream: bool,
    /// The writing system of the prompts.
    pub script: Script,
    pub seed: u64,
}

impl Default for TraceSpec {
    fn default() -> Self {
        TraceSpec {
            shape: TraceShape::Tenants,
            tenants: 8,
            prompt_words: 180,
            question_words: 12,
            rate: 20.0,
            requests: 64,
            hot: None,
            turns: None,
            model: "cc-sim".into(),
            max_tokens: 16,
            stream: false,
            script: Script::Latin,
            seed: 42,
        }
    }
}

const WORDS: &[&str] = &[
    "account",
    "agent",
    "answer",
    "archive",
    "audit",
    "balance",
    "batch",
    "billing",
    "branch",
    "budget",
    "cache",
    "catalog",
    "channel",
    "claim",
    "client",
    "cluster",
    "code",
    "compliance",
    "contract",
    "customer",
    "data",
    "deadline",
    "delivery",
    "deploy",
    "design",
    "device",
    "discount",
    "document",
    "draft",
    "email",
    "engine",
    "error",
    "estimate",
    "event",
    "export",
    "feature",
    "field",
    "file",
    "filter",
    "forecast",
    "format",
    "gateway",
    "guide",
    "handler",
    "history",
    "incident",
    "index",
    "invoice",
    "issue",
    "job",
    "journal",
    "key",
    "ledger",
    "license",
    "limit",
    "log",
    "market",
    "memo",
    "metric",
    "model",
    "module",
    "network",
    "node",
    "notice",
    "order",
    "owner",
    "package",
    "partner",
    "patch",
    "payment",
    "plan",
    "policy",
    "portal",
    "price",
    "priority",
    "product",
    "profile",
    "project",
    "quota",
    "record",
    "refund",
    "region",
    "release",
    "report",
    "request",
    "resource",
    "review",
    "risk",
    "route",
    "rule",
    "sale",
    "schedule",
    "schema",
    "score",
    "server",
    "service",
    "session",
    "shipment",
    "signal",
    "source",
    "status",
    "storage",
    "supplier",
    "support",
    "system",
    "table",
    "target",
    "task",
    "team",
    "template",
    "tenant",
    "ticket",
    "token",
    "tracker",
    "update",
    "user",
    "vendor",
    "version",
    "volume",
    "warehouse",
    "workflow",
    "always",
    "never",
    "carefully",
    "quickly",
    "clearly",
    "politely",
    "briefly",
    "exactly",
    "only",
    "first",
    "then",
    "before",
    "after",
    "when",
    "unless",
    "check",
    "confirm",
    "explain",
    "list",
    "summarize",
    "reply",
    "escalate",
    "verify",
    "compare",
    "describe",
    "use",
    "keep",
    "avoid",
    "include",
    "mention",
    "the",
    "a",
    "of",
    "to",
    "and",
    "for",
    "with",
    "in",
    "on",
    "by",
    "each",
    "every",
    "your",
    "our",
    "their",
];

fn words(rng: &mut Pcg64Mcg, count: usize) -> String {
    let mut text = String::with_capacity(count * 8);
    for i in 0..count {
        let word = WORDS[draw_index(rng, WORDS.len())];
        let sentence_end = i + 1 == count || rng.gen_range(0..12) == 0;
        text.push_str(word);
        text.push_str(if sentence_end {
            if i + 1 == count {
                "."
            } else {
                ". "
            }
        } else if rng.gen_range(0..10) == 0 {
            ", "
        } else {
            " "
        });
    }
    text
}

impl TraceSpec {
    pub fn validate(&self) -> Result<(), TraceError> {
        let invalid = |field, expected| Err(TraceError::Invalid { field, expected });
        if self.tenants == 0 {
            return invalid("tenants", "at least 1");
        }
        if !(self.rate.is_finite() && self.rate >= 0.0) {
            return invalid("rate", "a finite number >= 0");
        }
        if let Some(hot) = self.hot {
            if !(0.0..=1.0).contains(&hot) {
                return invalid("hot", "a share in 0..1");
            }
        }
        if self.turns == Some(0) {
            return invalid("turns", "at least 1");
        }
        if self.question_words == 0 && self.prompt_words == 0 {
            return invalid("prompt_words", "at least 1 (with question_words)");
        }
        Ok(())
    }

    fn pick_group(&self, rng: &mut Pcg64Mcg) -> usize {
        match self.hot {
            Some(hot) if self.tenants > 1 => {
                if rng.gen_bool(hot) {
                    0
                } else {
                    1 + draw_index(rng, self.tenants - 1)
                }
            }
            _ => draw_index(rng, self.tenants),
        }
    }

    /// Generates the trace. The same spec always gives the same trace.
    /// A request's OpenAI chat body.
    fn body(&self, mut messages: Vec<Value>) -> Value {
        if self.script == Script::Han {
            for m in &mut messages {
                if let Some(text) = m["content"].as_str() {
                    m["content"] = Value::String(han(text));
                }
            }
        }
        let mut body =
            json!({"model": self.model, "messages": messages, "max_tokens": self.max_tokens});
        if self.stream {
            body["stream"] = Value::Bool(true);
        }
        body
    }

    pub fn generate(&self) -> Result<Vec<TraceRecord>, TraceError> {
        self.validate()?;
        let mut rng = Pcg64Mcg::seed_from_u64(self.seed);
        let shared_system = format!(
            "You are the assistant of this service. {}",
            words(&mut rng, self.prompt_words)
        );
        let group_texts: Vec<String> = (0..self.tenants)
            .map(|i| match self.shape {
                TraceShape::Tenants | TraceShape::Mixed => format!(
                    "You are the assistant of tenant {i}. {}",
                    words(&mut rng, self.prompt_words)
                ),
                TraceShape::Conversations | TraceShape::Unique => String::new(),
                TraceShape::Rag => format!("Document {i}: {}", words(&mut rng, self.prompt_words)),
            })
            .collect();
        let mut conversations: Vec<Vec<Value>> = vec![Vec::new(); self.tenants];
        // How many conversations each slot has ended (with `turns`): the next one's name.
        let mut ended = vec![0usize; self.tenants];
        let mut t = 0.0f64;
        let mut records = Vec::with_capacity(self.requests);
        for index in 0..self.requests {
            if self.rate > 0.0 {
                // Exponential inter-arrival times make a Poisson process.
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                t += -u.ln() / self.rate;
            }
            let g = self.pick_group(&mut rng);
            let question = words(&mut rng, self.question_words.max(1));
            let shape = match self.shape {
                TraceShape::Mixed if rng.gen_bool(0.5) => TraceShape::Tenants,
                TraceShape::Mixed => TraceShape::Conversations,
                shape => shape,
            };
            let (group, messages) = match shape {
                TraceShape::Unique => (
                    format!("request-{index}"),
                    vec![json!({
                        "role": "user",
                        // The request number first: no two prompts share even a first block.
                        "content": format!("Request {index}. {} {question}", words(&mut rng, self.prompt_words)),
                    })],
                ),
                TraceShape::Tenants => (
                    format!("tenant-{g}"),
                    vec![
                        json!({"role": "system", "content": group_texts[g]}),
                        json!({"role": "user", "content": question}),
                    ],
                ),
                TraceShape::Rag => (
                    format!("doc-{g}"),
                    vec![
                        json!({"role": "system", "content": "Answer from the document only."}),
                        json!({"role": "user", "content": format!("{}\n\nQuestion: {question}", group_texts[g])}),
                    ],
                ),
                // (`mixed` picked one of the two above.)
                TraceShape::Conversations | TraceShape::Mixed => {
                    let history = &mut conversations[g];
                    // A turn is a question and (after the first) the answer before it.
                    let turns_so_far = history.len() / 2;
                    if self.turns.is_some_and(|max| turns_so_far >= max) {
                        history.clear();
                        ended[g] += 1;
                    }
                    if history.is_empty() {
                        history.push(json!({"role": "system", "content": shared_system}));
                    } else {
                        let answer = words(&mut rng, self.question_words.max(1) * 2);
                        history.push(json!({"role": "assistant", "content": answer}));
                    }
                    history.push(json!({"role": "user", "content": question}));
                    // The first conversation of a slot keeps the name traces always had.
                    let group = match ended[g] {
                        0 => format!("conv-{g}"),
                        n => format!("conv-{g}.{n}"),
                    };
                    (group, history.clone())
                }
            };
            records.push(TraceRecord {
                t: (t * 1e6).round() / 1e6,
                group,
                body: self.body(messages),
            });
        }
        Ok(records)
    }
}

/// Reads a JSONL trace; blank lines are skipped, every other line must be a record.
pub fn parse_jsonl(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut records = Vec::new();
    let mut last_t = f64::NEG_INFINITY;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord = serde_json::from_str(line).map_err(|e| TraceError::Parse {
            line: i + 1,
            message: e.to_string(),
        })?;
        if !(record.t.is_finite() && record.t >= 0.0) {
            return Err(TraceError::Parse {
                line: i + 1,
                message: format!(
                    "t must be a finite number of seconds >= 0, got {}",
                    record.t
                ),
            });
        }
        if record.t < last_t {
            return Err(TraceError::Parse {
                line: i + 1,
                message: format!("t goes backwards ({} after {last_t})", record.t),
            });
        }
        last_t = record.t;
        records.push(record);
    }
    Ok(records)
}

/// Writes records as JSONL (one compact JSON object per line).
pub fn to_jsonl(records: &[TraceRecord]) -> String {
    let mut out = String::new();
    for r in records {
        // A record is plain data; serialising it cannot fail.
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        let a = TraceSpec::default().generate().unwrap();
        let b = TraceSpec::default().generate().unwrap();
        let c = TraceSpec {
            seed: 7,
            ..TraceSpec::default()
        }
        .generate()
        .unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn a_streaming_trace_asks_for_streams_and_is_otherwise_the_same_trace() {
        let plain = TraceSpec::default().generate().unwrap();
        let streamed = TraceSpec {
            stream: true,
            ..TraceSpec::default()
        }
        .generate()
        .unwrap();
        assert_eq!(plain.len(), streamed.len());
        for (p, s) in plain.iter().zip(&streamed) {
            assert_eq!(p.body.get("stream"), None);
            assert_eq!(s.body["stream"], true);
            let mut s = s.clone();
            s.body.as_object_mut().unwrap().remove("stream");
            assert_eq!(&s, p);
        }
    }

    #[test]
    fn poisson_rate_is_roughly_respected_and_zero_rate_is_back_to_back() {
        let spec = TraceSpec {
            requests: 2000,
            rate: 20.0,
            ..TraceSpec::default()
        };
        let trace = spec.generate().unwrap();
        let span = trace.last().unwrap().t;
        let measured = 2000.0 / span;
        assert!((16.0..24.0).contains(&measured), "{measured}");
        assert!(trace.windows(2).all(|w| w[0].t <= w[1].t));
        let flat = TraceSpec {
            rate: 0.0,
            ..TraceSpec::default()
        }
        .generate()
        .unwrap();
        assert!(flat.iter().all(|r| r.t == 0.0));
    }

    #[test]
    fn hot_tenant_gets_its_share() {
        let spec = TraceSpec {
            requests: 1000,
            hot: Some(0.7),
            ..TraceSpec::default()
        };
        let hot = spec
            .generate()
            .unwrap()
            .iter()
            .filter(|r| r.group == "tenant-0")
            .count();
        assert!((630..770).contains(&hot), "{hot}");
    }

    #[test]
    fn tenants_share_their_system_prompt() {
        let trace = TraceSpec::default().generate().unwrap();
        let system = |r: &TraceRecord| {
            r.body["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let t0: Vec<&TraceRecord> = trace.iter().filter(|r| r.group == "tenant-0").collect();
        assert!(t0.len() > 1);
        assert!(t0.iter().all(|r| system(r) == system(t0[0])));
        let other = trace.iter().find(|r| r.group != "tenant-0").unwrap();
        assert_ne!(system(other), system(t0[0]));
        // 180 words plus punctuation.
        assert!(
            prefixroute_core::tokenizer::tokenize(&system(t0[0]), Default::default()).len() > 180
        );
    }

    #[test]
    fn conversations_grow_turn_by_turn() {
        let spec = TraceSpec {
            shape: TraceShape::Conversations,
            tenants: 2,
            requests: 10,
            ..TraceSpec::default()
        };
        let trace = spec.generate().unwrap();
        let conv: Vec<&TraceRecord> = trace.iter().filter(|r| r.group == "conv-0").collect();
        let lens: Vec<usize> = conv
            .iter()
            .map(|r| r.body["messages"].as_array().unwrap().len())
            .collect();
        assert!(lens.windows(2).all(|w| w[1] == w[0] + 2), "{lens:?}");
    }

    #[test]
    fn conversations_with_a_turn_limit_end_and_new_ones_take_their_slot() {
        let spec = TraceSpec {
            shape: TraceShape::Conversations,
            tenants: 2,
            requests: 40,
            turns: Some(3),
            ..TraceSpec::default()
        };
        let trace = spec.generate().unwrap();
        let messages = |r: &TraceRecord| r.body["messages"].as_array().unwrap().clone();
        let mut groups: Vec<&str> = trace.iter().map(|r| r.group.as_str()).collect();
        groups.sort_unstable();
        groups.dedup();
        assert!(groups.len() > 4, "{groups:?}");
        let system = messages(&trace[0])[0].clone();
        for group in groups {
            let conv: Vec<&TraceRecord> = trace.iter().filter(|r| r.group == group).collect();
            assert!(conv.len() <= 3, "{group}: {} turns", conv.len());
            // Each conversation starts over from the shared system prompt and grows by a turn.
            let lens: Vec<usize> = conv.iter().map(|r| messages(r).len()).collect();
            assert_eq!(lens[0], 2, "{group}: {lens:?}");
            assert!(lens.windows(2).all(|w| w[1] == w[0] + 2), "{lens:?}");
            assert!(conv.iter().all(|r| messages(r)[0] == system));
        }
    }

    #[test]
    fn a_turn_limit_no_conversation_reaches_leaves_the_trace_as_it_was() {
        let spec = TraceSpec {
            shape: TraceShape::Mixed,
            tenants: 3,
            requests: 200,
            ..TraceSpec::default()
        };
        let limited = TraceSpec {
            turns: Some(200),
            ..spec.clone()
        };
        assert_eq!(spec.generate().unwrap(), limited.generate().unwrap());
        let ended = TraceSpec {
            turns: Some(2),
            ..spec.clone()
        };
        assert_ne!(spec.generate().unwrap(), ended.generate().unwrap());
        let zero = TraceSpec {
            turns: Some(0),
            ..spec
        };
        assert!(zero.generate().is_err());
    }

    #[test]
    fn mixed_traces_carry_tenants_questions_and_growing_conversations() {
        let spec = TraceSpec {
            shape: TraceShape::Mixed,
            tenants: 3,
            requests: 400,
            ..TraceSpec::default()
        };
        let trace = spec.generate().unwrap();
        let tenants: Vec<&TraceRecord> = trace
            .iter()
            .filter(|r| r.group.starts_with("tenant-"))
            .collect();
        // Even odds: 400 fair coins land within 60 of 200 (more than 6 standard deviations).
        assert!((140..=260).contains(&tenants.len()), "{}", tenants.len());
        let system = |r: &TraceRecord| {
            r.body["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        // A tenant's questions share its own system prompt and never grow...
        for r in &tenants {
            let messages = r.body["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 2);
            let tenant = r.group.trim_start_matches("tenant-");
            assert!(
                system(r).contains(&format!("tenant {tenant}.")),
                "{}",
                system(r)
            );
        }
        // ...while conversations share one system prompt, unlike any tenant's, and grow.
        let conv: Vec<&TraceRecord> = trace.iter().filter(|r| r.group == "conv-0").collect();
        assert!(conv.len() > 10);
        assert!(conv.iter().all(|r| system(r) == system(conv[0])));
        assert!(tenants.iter().all(|r| system(r) != system(conv[0])));
        let lens: Vec<usize> = conv
            .iter()
            .map(|r| r.body["messages"].as_array().unwrap().len())
            .collect();
        assert!(lens.windows(2).all(|w| w[1] == w[0] + 2), "{lens:?}");
        assert_eq!(TraceShape::ALL.len(), 5);
    }

    #[test]
    fn a_han_trace_is_the_same_trace_in_chinese_characters_told_apart_by_the_router() {
        use prefixroute_core::hashing::{hash_request, HashConfig};
        use prefixroute_core::tokenizer::NonAscii;
        let latin = TraceSpec {
            tenants: 4,
            requests: 40,
            ..TraceSpec::default()
        };
        let han = TraceSpec {
            script: Script::Han,
            ..latin.clone()
        };
        let (latin, han) = (latin.generate().unwrap(), han.generate().unwrap());
        let content = |r: &TraceRecord, m: usize| {
            r.body["messages"][m]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let system = content(&han[0], 0);
        assert!(system.chars().filter(|c| !c.is_ascii()).count() > system.chars().count() * 9 / 10);
        let blocks = |r: &TraceRecord, non_ascii| {
            let parsed = prefixroute_core::parse_request(r.body.to_string().as_bytes()).unwrap();
            let config = HashConfig {
                non_ascii,
                ..HashConfig::default()
            };
            hash_request(&parsed, config).chains[0].clone()
        };
        for (l, h) in latin.iter().zip(&han) {
            // The same arrivals and groups; the same word, the same characters.
            assert_eq!((l.t, &l.group), (h.t, &h.group));
            assert_eq!(
                content(l, 0) == content(&latin[0], 0),
                content(h, 0) == system
            );
            // Each tenant's questions share its prefix and no other tenant's.
            let other = han.iter().find(|o| o.group != h.group).unwrap();
            let shared = |a: &[u64], b: &[u64]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
            let (mine, theirs) = (blocks(h, NonAscii::Pieces), blocks(other, NonAscii::Pieces));
            assert!(
                shared(&mine, &theirs) <= 1,
                "{} and {}",
                h.group,
                other.group
            );
            if h.group == han[0].group {
                assert!(shared(&mine, &blocks(&han[0], NonAscii::Pieces)) >= mine.len() / 2);
            }
            // Skipped, every tenant's prompt is its chat headers and its digits.
            assert!(blocks(h, NonAscii::Skip).len() <= 1);
        }
    }

    #[test]
    fn unique_requests_share_no_block() {
        use prefixroute_core::hashing::{hash_request, HashConfig};
        let spec = TraceSpec {
            shape: TraceShape::Unique,
            prompt_words: 50,
            requests: 40,
            ..TraceSpec::default()
        };
        let trace = spec.generate().unwrap();
        let mut first_blocks = std::collections::HashSet::new();
        for record in &trace {
            let parsed = prefixroute_core::request::parse_value(&record.body).unwrap();
            let hashes = hash_request(&parsed, HashConfig::default());
            assert!(first_blocks.insert(hashes.chains[0][0]), "{}", record.group);
        }
        assert_eq!(trace[7].group, "request-7");
    }

    #[test]
    fn jsonl_round_trips_and_reports_bad_lines() {
        let trace = TraceSpec {
            requests: 5,
            ..TraceSpec::default()
        }
        .generate()
        .unwrap();
        assert_eq!(parse_jsonl(&to_jsonl(&trace)).unwrap(), trace);
        let err = parse_jsonl("{\"t\":0,\"group\":\"g\",\"body\":{}}\nnot json\n").unwrap_err();
        assert!(err.to_string().starts_with("line 2: "), "{err}");
        assert!(parse_jsonl(
            "{\"t\":1,\"group\":\"g\",\"body\":{}}\n{\"t\":0,\"group\":\"g\",\"body\":{}}"
        )
        .is_err());
        assert!(parse_jsonl("{\"t\":0,\"group\":\"g\",\"body\":{},\"x\":1}").is_err());
    }

    #[test]
    fn invalid_specs_are_refused() {
        assert!(TraceSpec {
            tenants: 0,
            ..TraceSpec::default()
        }
        .generate()
        .is_err());
        assert!(TraceSpec {
            hot: Some(1.5),
            ..TraceSpec::default()
        }
        .generate()
        .is_err());
        assert!(TraceSpec {
            rate: -1.0,
            ..TraceSpec::default()
        }
        .generate()
        .is_err());
    }
}
