//! Request body → prompt.
//!
//! Only the parts of an OpenAI request that decide which KV-cache blocks it needs are kept:
//! the model, the `cache_salt`, and the prompt text (or token ids). Everything else in the body
//! (sampling parameters, tools, …) is ignored, because it does not change the prefix.

use serde_json::Value;
use thiserror::Error;

/// Why a body could not be turned into a prompt. Messages are stable: they appear in logs and
/// in the plugin's debug headers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    #[error("body is not a JSON object")]
    NotAnObject,
    #[error("body has neither `messages` nor `prompt`")]
    MissingPrompt,
    #[error("`messages` is empty")]
    EmptyMessages,
    #[error("`prompt` is empty")]
    EmptyPrompt,
    #[error("`{field}` must be {expected}")]
    WrongType {
        field: String,
        expected: &'static str,
    },
}

/// One prompt as the server will see it: text to tokenize, or token ids given by the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The routing-relevant content of an OpenAI chat or completions body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    pub model: String,
    pub cache_salt: Option<String>,
    /// One entry for chat; one per element for a completions `prompt` list, since the server
    /// runs (and caches) each of them as its own sequence.
    pub prompts: Vec<Prompt>,
    /// Chat only: the byte offsets in the prompt text where each message after the first
    /// starts. Requests share prefixes up to message boundaries (a system prompt, a document,
    /// the previous turns), so the belief records the blocks that end there.
    pub boundaries: Vec<usize>,
    pub stream: bool,
    pub max_tokens: Option<u32>,
}

fn wrong(field: impl Into<String>, expected: &'static str) -> RequestError {
    RequestError::WrongType {
        field: field.into(),
        expected,
    }
}

/// What a chat message's header puts before and after its role in the prompt text:
/// `<|role|>\n` (the content and a newline follow).
pub(crate) const HEADER: [&str; 2] = ["<|", "|>\n"];

pub(crate) fn push_header(text: &mut String, role: &str) {
    text.push_str(HEADER[0]);
    text.push_str(role);
    text.push_str(HEADER[1]);
}

mod raw;
#[cfg(test)]
mod tree_walk;
mod visit;

pub use raw::{read_request, JsonStr, RawMessage, RawPrompt, RawRequest};

use serde::de::DeserializeSeed;
use visit::{BodyFields, BodySeed, Chat, Scalar};

/// Parses a request body, reading only the fields routing needs, in one pass over the bytes
/// (see `visit`): nothing else of the body is allocated.
pub fn parse_request(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let not_json = |e: serde_json::Error| RequestError::NotJson(e.to_string());
    let mut de = serde_json::Deserializer::from_slice(body);
    let seed = BodySeed {
        capacity: body.len(),
    };
    let fields = seed.deserialize(&mut de).map_err(not_json)?;
    de.end().map_err(not_json)?;
    fields.finish()
}

/// Parses an already decoded body (used by trace files, which embed bodies as JSON values),
/// with the same reading as [`parse_request`].
pub fn parse_value(value: &Value) -> Result<ParsedRequest, RequestError> {
    BodySeed { capacity: 0 }
        .deserialize(value)
        .map_err(|e| RequestError::NotJson(e.to_string()))?
        .finish()
}

impl BodyFields<'_> {
    /// The request, or the first shape error in a fixed order: model, cache_salt, stream,
    /// max tokens, then the prompt (`messages` before `prompt`).
    fn finish(self) -> Result<ParsedRequest, RequestError> {
        if !self.is_object {
            return Err(RequestError::NotAnObject);
        }
        let model = match self.model {
            None | Some(Scalar::Null) => String::new(),
            Some(Scalar::Str(s)) => s.into_owned(),
            Some(_) => return Err(wrong("model", "a string")),
        };
        let cache_salt = match self.cache_salt {
            None | Some(Scalar::Null) => None,
            Some(Scalar::Str(s)) => Some(s.into_owned()),
            Some(_) => return Err(wrong("cache_salt", "a string")),
        };
        let stream = match self.stream {
            None | Some(Scalar::Null) => false,
            Some(Scalar::Bool(b)) => b,
            Some(_) => return Err(wrong("stream", "a boolean")),
        };
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None | Some(Scalar::Null) => None,
            Some(Scalar::Uint(n)) if u32::try_from(n).is_ok() => u32::try_from(n).ok(),
            Some(_) => return Err(wrong("max_tokens", "a non-negative integer")),
        };
        let (prompts, boundaries) = match (self.messages, self.prompt) {
            (Some(chat), _) => {
                let Chat { text, boundaries } = chat?;
                (vec![Prompt::Text(text)], boundaries)
            }
            (None, Some(prompts)) => (prompts?, Vec::new()),
            (None, None) => return Err(RequestError::MissingPrompt),
        };
        Ok(ParsedRequest {
            model,
            cache_salt,
            prompts,
            boundaries,
            stream,
            max_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ParsedRequest, RequestError> {
        parse_request(s.as_bytes())
    }

    #[test]
    fn chat_messages_are_flattened_in_order_with_roles() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"stream":true,"max_tokens":7}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(
            r.prompts,
            vec![Prompt::Text("<|system|>\nbe brief\n<|user|>\nhi\n".into())]
        );
        assert_eq!(r.boundaries, vec!["<|system|>\nbe brief\n".len()]);
    }

    #[test]
    fn longer_conversation_extends_the_shorter_prefix() {
        let a = parse(
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#,
        )
        .unwrap();
        let b = parse(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"}]}"#).unwrap();
        let (Prompt::Text(a), Prompt::Text(b)) = (&a.prompts[0], &b.prompts[0]) else {
            panic!("text prompts expected")
        };
        assert!(b.starts_with(a.as_str()));
    }

    #[test]
    fn content_parts_keep_text_and_image_references() {
        let r = parse(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"look "},{"type":"image_url","image_url":{"url":"http://x/a.png"}}]}]}"#).unwrap();
        assert_eq!(
            r.prompts,
            vec![Prompt::Text(
                "<|user|>\nlook <|image_url|>http://x/a.png\n".into()
            )]
        );
    }

    #[test]
    fn completions_prompt_shapes() {
        assert_eq!(
            parse(r#"{"prompt":"abc","cache_salt":"t1"}"#).unwrap(),
            ParsedRequest {
                model: String::new(),
                cache_salt: Some("t1".into()),
                prompts: vec![Prompt::Text("abc".into())],
                boundaries: vec![],
                stream: false,
                max_tokens: None,
            }
        );
        assert_eq!(parse(r#"{"prompt":["a","b"]}"#).unwrap().prompts.len(), 2);
        assert_eq!(
            parse(r#"{"prompt":[1,2,3]}"#).unwrap().prompts,
            vec![Prompt::Tokens(vec![1, 2, 3])]
        );
        assert_eq!(
            parse(r#"{"prompt":[[1],[2,3]]}"#).unwrap().prompts,
            vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])]
        );
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        assert!(matches!(parse("{"), Err(RequestError::NotJson(_))));
        assert_eq!(parse("[1]"), Err(RequestError::NotAnObject));
        assert_eq!(parse("{}"), Err(RequestError::MissingPrompt));
        assert_eq!(
            parse(r#"{"messages":[]}"#),
            Err(RequestError::EmptyMessages)
        );
        assert_eq!(parse(r#"{"prompt":[]}"#), Err(RequestError::EmptyPrompt));
        assert_eq!(
            parse(r#"{"messages":"hi"}"#).unwrap_err().to_string(),
            "`messages` must be an array"
        );
        assert_eq!(
            parse(r#"{"messages":[{"content":"x"}]}"#)
                .unwrap_err()
                .to_string(),
            "`messages[0].role` must be a string"
        );
        assert_eq!(
            parse(r#"{"messages":[{"role":"user","content":5}]}"#)
                .unwrap_err()
                .to_string(),
            "`messages[0].content` must be a string or an array of parts"
        );
        assert!(parse(r#"{"prompt":[1,-2]}"#).is_err());
        assert!(parse(r#"{"prompt":[1,"a"]}"#).is_err());
        assert!(parse(r#"{"prompt":5}"#).is_err());
        assert!(parse(r#"{"prompt":"a","model":3}"#).is_err());
        assert!(parse(r#"{"prompt":"a","stream":"yes"}"#).is_err());
        assert!(parse(r#"{"prompt":"a","max_tokens":-1}"#).is_err());
    }
    #[test]
    fn a_repeated_key_keeps_its_last_value_as_a_json_map_would() {
        for body in [
            r#"{"messages":[{"role":"user","content":"a","content":"b"}]}"#,
            r#"{"messages":[{"content":"a","role":"user","role":"system"}]}"#,
            r#"{"messages":[{"role":"user","content":"a","role":"system"}]}"#,
            r#"{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"x","content":"y"}]}"#,
            r#"{"prompt":"a","prompt":[1,2],"model":"m","model":"n"}"#,
            r#"{"messages":[{"content":[{"text":"t","type":"text","type":"image_url","image_url":{"url":"u"}}],"role":"user"}]}"#,
        ] {
            assert_eq!(
                parse(body),
                tree_walk::parse_request(body.as_bytes()),
                "{body}"
            );
        }
        assert_eq!(
            parse(r#"{"messages":[{"role":"user","content":"a","content":"b"}]}"#)
                .unwrap()
                .prompts,
            vec![Prompt::Text("<|user|>\nb\n".into())]
        );
    }

    #[test]
    fn the_role_may_come_after_the_content() {
        let r = parse(r#"{"messages":[{"content":"be brief","role":"system"},{"content":"hi","role":"user"}]}"#).unwrap();
        assert_eq!(
            r.prompts,
            vec![Prompt::Text("<|system|>\nbe brief\n<|user|>\nhi\n".into())]
        );
        assert_eq!(r.boundaries, vec!["<|system|>\nbe brief\n".len()]);
    }

    #[test]
    fn a_body_that_is_not_json_is_not_json_wherever_its_shape_is_wrong() {
        // The shape error comes first in the text, the syntax error later: still `NotJson`.
        assert!(matches!(
            parse(r#"{"messages":"hi","prompt":"#),
            Err(RequestError::NotJson(_))
        ));
        assert!(matches!(
            parse(r#"{"prompt":"a"} x"#),
            Err(RequestError::NotJson(_))
        ));
        assert_eq!(
            parse(r#"{"prompt":"a"} x"#),
            tree_walk::parse_request(br#"{"prompt":"a"} x"#)
        );
    }

    /// JSON values shaped like chat and completions bodies, right and wrong: objects whose
    /// keys are mostly the ones routing reads, with values that are mostly the right shape.
    fn body_strategy() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = prop_oneof![
            "[a-z ]{0,6}",
            Just("line\nbreak \"quoted\" \u{e9}".to_string()),
            Just("text".to_string()),
            Just("image_url".to_string()),
            Just("type".to_string()),
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (0u64..6_000_000_000).prop_map(Value::from),
            (0u64..100).prop_map(Value::from),
            (-3i64..0).prop_map(Value::from),
            Just(Value::from(1.5)),
            text.clone().prop_map(Value::String),
        ];
        let any_value = leaf.clone().prop_recursive(3, 20, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(("[a-z]{1,3}", inner), 0..3)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        });
        // An object from (key, value) choices, each key kept with probability ~3/4.
        fn object(
            fields: Vec<(&'static str, BoxedStrategy<Value>)>,
        ) -> impl Strategy<Value = Value> {
            fields
                .into_iter()
                .map(|(k, v)| proptest::option::weighted(0.75, v).prop_map(move |v| (k, v)))
                .collect::<Vec<_>>()
                .prop_map(|entries| {
                    Value::Object(
                        entries
                            .into_iter()
                            .filter_map(|(k, v)| Some((k.to_string(), v?)))
                            .collect(),
                    )
                })
        }
        let mostly =
            |right: BoxedStrategy<Value>| prop_oneof![4 => right, 1 => any_value.clone()].boxed();
        // The body's own scalars: wrong less often, so that the prompt's errors get their turn.
        let rarely_wrong =
            |right: BoxedStrategy<Value>| prop_oneof![20 => right, 1 => any_value.clone()].boxed();
        let url = object(vec![(
            "url",
            mostly(text.clone().prop_map(Value::String).boxed()),
        )]);
        let part = object(vec![
            ("type", mostly(text.clone().prop_map(Value::String).boxed())),
            ("text", mostly(text.clone().prop_map(Value::String).boxed())),
            ("image_url", mostly(url.boxed())),
        ]);
        let content = prop_oneof![
            text.clone().prop_map(Value::String),
            proptest::collection::vec(part, 0..3).prop_map(Value::Array),
        ];
        let message = object(vec![
            ("role", mostly(text.clone().prop_map(Value::String).boxed())),
            ("content", mostly(content.boxed())),
            ("name", any_value.clone().boxed()),
        ]);
        let ids = proptest::collection::vec(leaf.clone(), 0..4).prop_map(Value::Array);
        let prompt = prop_oneof![
            text.clone().prop_map(Value::String),
            ids.clone(),
            proptest::collection::vec(prop_oneof![text.clone().prop_map(Value::String), ids], 0..3)
                .prop_map(Value::Array),
        ];
        object(vec![
            (
                "model",
                rarely_wrong(text.clone().prop_map(Value::String).boxed()),
            ),
            (
                "cache_salt",
                rarely_wrong(text.clone().prop_map(Value::String).boxed()),
            ),
            (
                "stream",
                rarely_wrong(any::<bool>().prop_map(Value::Bool).boxed()),
            ),
            (
                "max_tokens",
                rarely_wrong((0u64..10).prop_map(Value::from).boxed()),
            ),
            (
                "max_completion_tokens",
                rarely_wrong(Just(Value::Null).boxed()),
            ),
            (
                "messages",
                mostly(
                    proptest::collection::vec(message, 0..4)
                        .prop_map(Value::Array)
                        .boxed(),
                ),
            ),
            ("prompt", mostly(prompt.boxed())),
            ("temperature", any_value.boxed()),
        ])
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn the_one_pass_reading_agrees_with_the_tree_walk_on_every_body(body in body_strategy()) {
            let bytes = serde_json::to_vec(&body).unwrap();
            let expected = tree_walk::parse_request(&bytes);
            proptest::prop_assert_eq!(&parse_request(&bytes), &expected);
            proptest::prop_assert_eq!(&parse_value(&body), &expected);
            // Cut short, it is not JSON for either (serde_json words the error by what it was
            // reading: a skipped value or a built one, so only the kind is compared).
            let cut = &bytes[..bytes.len() / 2];
            match (parse_request(cut), tree_walk::parse_request(cut)) {
                (Err(RequestError::NotJson(_)), Err(RequestError::NotJson(_))) => {}
                (ours, reference) => proptest::prop_assert_eq!(ours, reference),
            }
        }

        #[test]
        fn a_chat_read_in_place_is_one_parse_request_reads_the_same(body in body_strategy()) {
            let bytes = serde_json::to_vec(&body).unwrap();
            for body in [&bytes[..], &bytes[..bytes.len() / 2]] {
                if let Some(chat) = read_request(body) {
                    let parsed = parse_request(body);
                    proptest::prop_assert!(parsed.is_ok(), "read in place, refused by serde: {:?}", parsed);
                    raw::tests::assert_same_request(&chat, &parsed.unwrap())?;
                }
            }
        }
    }
}
