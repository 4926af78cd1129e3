//! The tree walk `parse_request` was before it read bodies in one pass (git 8f2cf88): a
//! `serde_json::Value` of the whole body, then its routing fields. Kept for tests only, as the
//! reference the one-pass reading must agree with on every body (see the property test in
//! the parent module).

use serde_json::Value;

use super::{wrong, ParsedRequest, Prompt, RequestError};

pub(super) fn parse_request(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    parse_value(&value)
}

pub(super) fn parse_value(value: &Value) -> Result<ParsedRequest, RequestError> {
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
