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

/// Parses a request body.
pub fn parse_request(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    parse_value(&value)
}

/// Parses an already decoded body (used by trace files, which embed bodies as JSON values).
pub fn parse_value(value: &Value) -> Result<ParsedRequest, RequestError> {
    let body = value.as_object().ok_or(RequestError::NotAnObject)?;
    let model = match body.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(wrong("model", "a string")),
    };
    let cache_salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(wrong("cache_salt", "a string")),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(wrong("stream", "a boolean")),
    };
    let max_tokens = match body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| wrong("max_tokens", "a non-negative integer"))?,
        ),
    };
    let mut boundaries = Vec::new();
    let prompts = if let Some(messages) = body.get("messages") {
        vec![Prompt::Text(flatten_messages(messages, &mut boundaries)?)]
    } else if let Some(prompt) = body.get("prompt") {
        completion_prompts(prompt)?
    } else {
        return Err(RequestError::MissingPrompt);
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

/// Chat messages flattened in order as `<|role|>\ncontent\n`, so that the same conversation
/// always yields the same text and a longer conversation extends a shorter one's prefix.
/// `boundaries` gets the byte offset where each message after the first starts.
fn flatten_messages(messages: &Value, boundaries: &mut Vec<usize>) -> Result<String, RequestError> {
    let list = messages
        .as_array()
        .ok_or_else(|| wrong("messages", "an array"))?;
    if list.is_empty() {
        return Err(RequestError::EmptyMessages);
    }
    let mut text = String::new();
    for (i, message) in list.iter().enumerate() {
        let message = message
            .as_object()
            .ok_or_else(|| wrong(format!("messages[{i}]"), "an object"))?;
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| wrong(format!("messages[{i}].role"), "a string"))?;
        if i > 0 {
            boundaries.push(text.len());
        }
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        match message.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    push_content_part(&mut text, part, i, j)?;
                }
            }
            Some(_) => {
                return Err(wrong(
                    format!("messages[{i}].content"),
                    "a string or an array of parts",
                ))
            }
        }
        text.push('\n');
    }
    Ok(text)
}

/// A content part: text is kept as is; an image or audio part is kept by its reference, so
/// two requests with different images never look like the same prefix.
fn push_content_part(
    text: &mut String,
    part: &Value,
    i: usize,
    j: usize,
) -> Result<(), RequestError> {
    let field = || format!("messages[{i}].content[{j}]");
    let part = part
        .as_object()
        .ok_or_else(|| wrong(field(), "an object"))?;
    let kind = part
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| wrong(format!("{}.type", field()), "a string"))?;
    if kind == "text" {
        let t = part
            .get("text")
            .and_then(Value::as_str)
            .ok_or_else(|| wrong(format!("{}.text", field()), "a string"))?;
        text.push_str(t);
    } else {
        text.push_str("<|");
        text.push_str(kind);
        text.push_str("|>");
        if let Some(reference) = part.get(kind) {
            let url = reference.get("url").and_then(Value::as_str);
            match url {
                Some(url) => text.push_str(url),
                None => text.push_str(&reference.to_string()),
            }
        }
    }
    Ok(())
}

fn token_ids(value: &Value, field: &str) -> Result<Vec<u32>, RequestError> {
    let list = value.as_array().ok_or_else(|| wrong(field, "an array"))?;
    list.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| wrong(field, "token ids (non-negative integers)"))
        })
        .collect()
}

/// `prompt` may be a string, a list of strings, a list of token ids, or a list of such lists.
fn completion_prompts(prompt: &Value) -> Result<Vec<Prompt>, RequestError> {
    let expected = "a string, a list of strings, or token ids";
    match prompt {
        Value::String(s) => Ok(vec![Prompt::Text(s.clone())]),
        Value::Array(items) if items.is_empty() => Err(RequestError::EmptyPrompt),
        Value::Array(items) => match &items[0] {
            Value::Number(_) => Ok(vec![Prompt::Tokens(token_ids(prompt, "prompt")?)]),
            _ => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(_) => {
                        Ok(Prompt::Tokens(token_ids(item, &format!("prompt[{i}]"))?))
                    }
                    _ => Err(wrong(format!("prompt[{i}]"), "a string or token ids")),
                })
                .collect(),
        },
        _ => Err(wrong("prompt", expected)),
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
}
