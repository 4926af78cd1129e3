//! Response bodies shaped like vLLM's OpenAI server, so clients written against vLLM (and the
//! replayer) read them unchanged.

use serde_json::{json, Value};

/// Which OpenAI API a request came in on; it decides every response shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

impl Api {
    fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completions, _) => "text_completion",
        }
    }
}

/// Everything a response body says about one finished (or finishing) request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompts: usize,
    pub output_tokens: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

/// Every answer is the same cycle of words, so tests and demos can predict it and a response
/// never depends on timing or on which replica served it.
const WORDS: [&str; 8] = [
    "Prefix", "caching", "saves", "prefill", "on", "every", "shared", "token.",
];

/// The text of output token `i`: one word and the space after it, as a tokenizer would split.
pub fn token_text(i: usize) -> String {
    let word = WORDS[i % WORDS.len()];
    if i == 0 {
        word.to_string()
    } else {
        format!(" {word}")
    }
}

fn answer_text(output_tokens: usize) -> String {
    (0..output_tokens).map(token_text).collect()
}

impl Reply {
    pub fn new(api: Api, id: String, created: u64, model: String) -> Reply {
        Reply {
            api,
            id: format!("{}-{id}", api.id_prefix()),
            created,
            model,
            prompts: 1,
            output_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
        }
    }

    pub fn usage(&self) -> Value {
        let completion_tokens = self.output_tokens * self.prompts;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.api.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The non-streaming body: one choice per prompt (completions accepts a list of prompts).
    pub fn completion(&self) -> Value {
        let text = answer_text(self.output_tokens);
        let choices = (0..self.prompts)
            .map(|index| match self.api {
                Api::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                }),
                Api::Completions => json!({
                    "index": index,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                }),
            })
            .collect();
        let mut body = self.envelope(false, choices);
        body["usage"] = self.usage();
        body
    }

    /// vLLM opens a chat stream with a chunk that carries only the role.
    pub fn role_chunk(&self) -> Option<Value> {
        (self.api == Api::Chat).then(|| {
            self.envelope(
                true,
                vec![json!({
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                })],
            )
        })
    }

    /// Output token `step` of prompt `index`; the last one carries the finish reason.
    pub fn token_chunk(&self, index: usize, step: usize) -> Value {
        let finish = (step + 1 == self.output_tokens).then_some("length");
        let choice = match self.api {
            Api::Chat => json!({
                "index": index,
                "delta": {"content": token_text(step)},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Api::Completions => json!({
                "index": index,
                "text": token_text(step),
                "logprobs": null,
                "finish_reason": finish,
                "stop_reason": null,
            }),
        };
        self.envelope(true, vec![choice])
    }

    /// The chunk `stream_options.include_usage` asks for: no choices, only usage.
    pub fn usage_chunk(&self) -> Value {
        let mut body = self.envelope(true, Vec::new());
        body["usage"] = self.usage();
        body
    }
}

/// OpenAI's error envelope, which vLLM also uses.
pub fn error(message: &str, kind: &str, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// `GET /v1/models`.
pub fn models(model: &str, created: u64, max_model_len: usize) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": model,
            "parent": null,
            "max_model_len": max_model_len,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(api: Api) -> Reply {
        Reply {
            prompts: 1,
            output_tokens: 3,
            prompt_tokens: 40,
            cached_tokens: 32,
            ..Reply::new(api, "a-1".into(), 7, "m".into())
        }
    }

    #[test]
    fn completion_has_openai_shape_and_usage() {
        let body = reply(Api::Chat).completion();
        assert_eq!(body["id"], "chatcmpl-a-1");
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "Prefix caching saves"
        );
        assert_eq!(body["usage"]["total_tokens"], 43);
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
        let text = reply(Api::Completions).completion();
        assert_eq!(text["object"], "text_completion");
        assert_eq!(text["choices"][0]["text"], "Prefix caching saves");
    }

    #[test]
    fn stream_chunks_concatenate_to_the_answer() {
        let r = reply(Api::Chat);
        assert!(r.role_chunk().is_some());
        assert!(reply(Api::Completions).role_chunk().is_none());
        let text: String = (0..3)
            .map(|step| {
                r.token_chunk(0, step)["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(text, "Prefix caching saves");
        assert_eq!(
            r.token_chunk(0, 1)["choices"][0]["finish_reason"],
            Value::Null
        );
        assert_eq!(r.token_chunk(0, 2)["choices"][0]["finish_reason"], "length");
        let usage = r.usage_chunk();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["prompt_tokens"], 40);
    }
}
