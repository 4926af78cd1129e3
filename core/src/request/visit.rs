//! The body read in one pass, straight from its bytes.
//!
//! `parse_request` used to build a `serde_json::Value` of the whole body and then read the few
//! fields routing needs: every string of the body (a 64 KB prompt, tool schemas, sampling
//! parameters) was allocated once into the tree and copied again into the prompt. Here serde
//! hands each value to a visitor as the parser reaches it: the message texts go from the
//! parser's buffer (or the body itself, when a string has no escapes) straight into the prompt,
//! and everything routing does not read is skipped without being built.
//!
//! The visitors never fail on a value of the wrong shape: they note the first
//! [`RequestError`] where the old tree walk would have found it, consume the value, and go on.
//! Only a syntax error stops the parse, so a body that is not JSON is `NotJson` wherever the
//! shape is wrong, and the shape errors keep their order and messages (see [`BodyFields::finish`]).
//! The same visitors read an already decoded `&Value` (trace files), so there is one reading of
//! a body, not two; the tree walk it replaced is kept as the tests' reference (`tree_walk.rs`).
//!
//! Measured with the host-tests table (3 endpoints): a 54-token chat request 132,835 -> 122,847
//! wasm instructions, a 1k-token one 362,765 -> 351,816 (the tree's allocations were a fixed
//! cost of every request); the .wasm grows by 28 KB (each visitor instantiates the parser's
//! value dispatch once).

use std::borrow::Cow;
use std::fmt;

use serde::de::{
    DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::Value;

use super::{push_header, wrong, Prompt, RequestError, HEADER};

/// A visitor's `visit_bool`/`visit_u64`/`visit_i64`/`visit_f64` (and with `str`, `visit_str`)
/// answering as its `visit_unit` does: the scalars that are all the same wrong shape for it.
macro_rules! other_scalars_are_unit {
    () => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            self.visit_unit()
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            self.visit_unit()
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            self.visit_unit()
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            self.visit_unit()
        }
    };
    (str) => {
        other_scalars_are_unit!();
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            self.visit_unit()
        }
    };
}

/// A scalar as routing reads it; objects, arrays and numbers it has no use for are consumed and
/// kept only as "something else" (enough for a typed error).
pub(super) enum Scalar<'de> {
    Null,
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// Any other number (negative, fractional).
    Number,
    Str(Cow<'de, str>),
    Other,
}

impl<'de> Scalar<'de> {
    fn into_str(self) -> Option<Cow<'de, str>> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Scalar::Uint(v))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(u64::try_from(v).map_or(Scalar::Number, Scalar::Uint))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Scalar::Number)
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| Scalar::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| Scalar::Other)
    }
}

impl<'de> serde::Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A map key as a string: borrowed from the body when it has no escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_str(ScalarVisitor)? {
            Scalar::Str(s) => Ok(Key(s)),
            _ => Err(D::Error::custom("a map key that is not a string")),
        }
    }
}

/// The fields of a body routing reads, as found; [`BodyFields::finish`] checks them in the
/// order the old tree walk did. `None` is an absent key (a repeated key keeps its last value,
/// as a `Value` map would).
#[derive(Default)]
pub(super) struct BodyFields<'de> {
    pub(super) is_object: bool,
    pub(super) model: Option<Scalar<'de>>,
    pub(super) cache_salt: Option<Scalar<'de>>,
    pub(super) stream: Option<Scalar<'de>>,
    pub(super) max_tokens: Option<Scalar<'de>>,
    pub(super) max_completion_tokens: Option<Scalar<'de>>,
    pub(super) messages: Option<Result<Chat, RequestError>>,
    pub(super) prompt: Option<Result<Vec<Prompt>, RequestError>>,
}

/// A chat request's prompt: the flattened messages and where each message after the first
/// starts.
pub(super) struct Chat {
    pub(super) text: String,
    pub(super) boundaries: Vec<usize>,
}

/// Reads a body; `capacity` is the body's size, which bounds the chat text (less its markup), so
/// the text is allocated once.
pub(super) struct BodySeed {
    pub(super) capacity: usize,
}

impl<'de> DeserializeSeed<'de> for BodySeed {
    type Value = BodyFields<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(BodyVisitor {
            capacity: self.capacity,
        })
    }
}

struct BodyVisitor {
    capacity: usize,
}

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = BodyFields<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut body = BodyFields {
            is_object: true,
            ..BodyFields::default()
        };
        while let Some(Key(key)) = map.next_key()? {
            match key.as_ref() {
                "model" => body.model = Some(map.next_value()?),
                "cache_salt" => body.cache_salt = Some(map.next_value()?),
                "stream" => body.stream = Some(map.next_value()?),
                "max_tokens" => body.max_tokens = Some(map.next_value()?),
                "max_completion_tokens" => body.max_completion_tokens = Some(map.next_value()?),
                "messages" => {
                    let seed = MessagesSeed {
                        capacity: self.capacity,
                    };
                    body.messages = Some(map.next_value_seed(seed)?);
                }
                "prompt" => body.prompt = Some(map.next_value_seed(PromptSeed)?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(body)
    }
    // Anything but an object is `NotAnObject` (after the rest is checked to be JSON).
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| BodyFields::default())
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(BodyFields::default())
    }
    other_scalars_are_unit!(str);
}

/// `messages`: flattened in order as `<|role|>\ncontent\n` (see `flatten` in the parent).
struct MessagesSeed {
    capacity: usize,
}

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = Result<Chat, RequestError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed {
    type Value = Result<Chat, RequestError>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut chat = Chat {
            text: String::with_capacity(self.capacity),
            boundaries: Vec::new(),
        };
        let mut index = 0;
        loop {
            let seed = MessageSeed {
                index,
                chat: &mut chat,
            };
            match seq.next_element_seed(seed)? {
                None if index == 0 => return Ok(Err(RequestError::EmptyMessages)),
                None => return Ok(Ok(chat)),
                Some(Ok(())) => index += 1,
                Some(Err(e)) => return drain_seq(seq).map(|()| Err(e)),
            }
        }
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| Err(wrong("messages", "an array")))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Err(wrong("messages", "an array")))
    }
    other_scalars_are_unit!(str);
}

/// One message, appended to the chat text. Its content is written as it is parsed; the
/// `<|role|>\n` header goes in front of it when the role is known (usually before the content;
/// otherwise it is inserted once the message ends).
struct MessageSeed<'a> {
    index: usize,
    chat: &'a mut Chat,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = Result<(), RequestError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn header(role: &str) -> String {
    let mut h = String::with_capacity(HEADER[0].len() + role.len() + HEADER[1].len());
    push_header(&mut h, role);
    h
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = Result<(), RequestError>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let i = self.index;
        let chat = self.chat;
        let start = chat.text.len();
        let mut role: Option<Scalar<'de>> = None;
        // The header written in front of the content, if any, by its role.
        let mut written: Option<Cow<'de, str>> = None;
        let mut content: Result<(), RequestError> = Ok(());
        while let Some(Key(key)) = map.next_key()? {
            match key.as_ref() {
                "role" => role = Some(map.next_value()?),
                "content" => {
                    // A repeated key replaces the earlier value, as in a `Value` map.
                    chat.text.truncate(start);
                    written = None;
                    if let Some(Scalar::Str(r)) = &role {
                        push_header(&mut chat.text, r);
                        written = Some(r.clone());
                    }
                    content = map.next_value_seed(ContentSeed {
                        message: i,
                        text: &mut chat.text,
                    })?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        // The role is checked before the content, as the tree walk did.
        let Some(role) = role.and_then(Scalar::into_str) else {
            return Ok(Err(wrong(format!("messages[{i}].role"), "a string")));
        };
        if let Err(e) = content {
            return Ok(Err(e));
        }
        match written {
            Some(w) if w == role => {}
            Some(w) => chat.text.replace_range(
                start..start + HEADER[0].len() + w.len() + HEADER[1].len(),
                &header(&role),
            ),
            None => chat.text.insert_str(start, &header(&role)),
        }
        chat.text.push('\n');
        if i > 0 {
            chat.boundaries.push(start);
        }
        Ok(Ok(()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let i = self.index;
        drain_seq(seq).map(|()| Err(wrong(format!("messages[{i}]"), "an object")))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Err(wrong(format!("messages[{}]", self.index), "an object")))
    }
    other_scalars_are_unit!(str);
}

/// A message's `content`: a string, null, or a list of parts, appended to the text.
struct ContentSeed<'a> {
    message: usize,
    text: &'a mut String,
}

impl ContentSeed<'_> {
    fn wrong_type(&self) -> RequestError {
        wrong(
            format!("messages[{}].content", self.message),
            "a string or an array of parts",
        )
    }
}

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = Result<(), RequestError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
    type Value = Result<(), RequestError>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("message content")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.text.push_str(v);
        Ok(Ok(()))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut part = 0;
        while let Some(done) = seq.next_element_seed(PartSeed {
            message: self.message,
            part,
            text: &mut *self.text,
        })? {
            if let Err(e) = done {
                return drain_seq(seq).map(|()| Err(e));
            }
            part += 1;
        }
        Ok(Ok(()))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let e = self.wrong_type();
        drain_map(map).map(|()| Err(e))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Err(self.wrong_type()))
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Err(self.wrong_type()))
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Err(self.wrong_type()))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Err(self.wrong_type()))
    }
}

/// One content part: text is kept as is; an image or audio part is kept by its reference, so
/// two requests with different images never look like the same prefix.
struct PartSeed<'a> {
    message: usize,
    part: usize,
    text: &'a mut String,
}

impl PartSeed<'_> {
    fn field(&self) -> String {
        format!("messages[{}].content[{}]", self.message, self.part)
    }
}

impl<'de> DeserializeSeed<'de> for PartSeed<'_> {
    type Value = Result<(), RequestError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_> {
    type Value = Result<(), RequestError>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content part")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kind: Option<Scalar<'de>> = None;
        let mut text: Option<Scalar<'de>> = None;
        // The other keys, kept whole: one of them is the reference a non-text part names by
        // its type, which may come before `type` itself. Parts are small; text is not kept here.
        let mut others: Vec<(Cow<'de, str>, Value)> = Vec::new();
        while let Some(Key(key)) = map.next_key()? {
            match key.as_ref() {
                "type" => kind = Some(map.next_value()?),
                "text" => text = Some(map.next_value()?),
                _ => {
                    let value: Value = map.next_value()?;
                    others.push((key, value));
                }
            }
        }
        let Some(kind) = kind.and_then(Scalar::into_str) else {
            return Ok(Err(wrong(format!("{}.type", self.field()), "a string")));
        };
        if kind == "text" {
            let Some(t) = text.and_then(Scalar::into_str) else {
                return Ok(Err(wrong(format!("{}.text", self.field()), "a string")));
            };
            self.text.push_str(&t);
            return Ok(Ok(()));
        }
        self.text.push_str("<|");
        self.text.push_str(&kind);
        self.text.push_str("|>");
        // The part's own `type` is a reference too when the type names itself.
        let reference = if kind == "type" {
            Some(Value::String(kind.to_string()))
        } else {
            others
                .into_iter()
                .rev()
                .find(|(k, _)| *k == kind)
                .map(|(_, v)| v)
        };
        if let Some(reference) = reference {
            match reference.get("url").and_then(Value::as_str) {
                Some(url) => self.text.push_str(url),
                None => self.text.push_str(&reference.to_string()),
            }
        }
        Ok(Ok(()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let e = wrong(self.field(), "an object");
        drain_seq(seq).map(|()| Err(e))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Err(wrong(self.field(), "an object")))
    }
    other_scalars_are_unit!(str);
}

const TOKEN_IDS: &str = "token ids (non-negative integers)";

/// A completions `prompt`: a string, a list of strings, a list of token ids, or a list of such
/// lists. The first element of a list decides whether it is one list of token ids.
struct PromptSeed;

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Result<Vec<Prompt>, RequestError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn wrong_prompt() -> RequestError {
    wrong("prompt", "a string, a list of strings, or token ids")
}

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Result<Vec<Prompt>, RequestError>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Ok(vec![Prompt::Text(v.to_owned())]))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Ok(vec![Prompt::Text(v)]))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let Some(first) = seq.next_element::<Item>()? else {
            return Ok(Err(RequestError::EmptyPrompt));
        };
        let mut prompts = Vec::new();
        if let Item::Number(id) = first {
            // One list of token ids: every element must be one.
            let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
            let mut id = id;
            loop {
                match id {
                    Some(t) => ids.push(t),
                    None => return drain_seq(seq).map(|()| Err(wrong("prompt", TOKEN_IDS))),
                }
                id = match seq.next_element::<Item>()? {
                    None => break,
                    Some(Item::Number(id)) => id,
                    Some(_) => None,
                };
            }
            prompts.push(Prompt::Tokens(ids));
            return Ok(Ok(prompts));
        }
        let mut item = Some(first);
        let mut i = 0;
        while let Some(current) = item {
            let prompt = match current {
                Item::Text(s) => Prompt::Text(s),
                Item::Tokens(Some(ids)) => Prompt::Tokens(ids),
                Item::Tokens(None) => {
                    let e = wrong(format!("prompt[{i}]"), TOKEN_IDS);
                    return drain_seq(seq).map(|()| Err(e));
                }
                Item::Number(_) | Item::Other => {
                    let e = wrong(format!("prompt[{i}]"), "a string or token ids");
                    return drain_seq(seq).map(|()| Err(e));
                }
            };
            prompts.push(prompt);
            item = seq.next_element()?;
            i += 1;
        }
        Ok(Ok(prompts))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| Err(wrong_prompt()))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Err(wrong_prompt()))
    }
    other_scalars_are_unit!();
}

/// One element of a `prompt` list.
enum Item {
    Text(String),
    /// A number: `Some` when it is a token id (fits a u32).
    Number(Option<u32>),
    /// A list: `Some` when every element is a token id.
    Tokens(Option<Vec<u32>>),
    Other,
}

impl<'de> serde::Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt element")
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Item, E> {
        Ok(Item::Number(u32::try_from(v).ok()))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Item, E> {
        Ok(Item::Number(u32::try_from(v).ok()))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Item, E> {
        Ok(Item::Number(None))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Item, E> {
        Ok(Item::Text(v.to_owned()))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Item, E> {
        Ok(Item::Text(v))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Item, E> {
        Ok(Item::Other)
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Item, E> {
        Ok(Item::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element::<Item>()? {
            match item {
                Item::Number(Some(t)) => ids.push(t),
                _ => return drain_seq(seq).map(|()| Item::Tokens(None)),
            }
        }
        Ok(Item::Tokens(Some(ids)))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
        drain_map(map).map(|()| Item::Other)
    }
}
