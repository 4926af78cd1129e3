//! vLLM's KV-cache events on the wire (`vllm/distributed/kv_events.py`).
//!
//! A publisher sends ZMQ multipart messages `[topic, sequence (8 bytes, big-endian), payload]`;
//! the payload is a msgpack `KVEventBatch`, an array `[ts, [event, …], data_parallel_rank]`, and
//! each event a tagged array:
//!
//! * `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
//! * `["BlockRemoved", block_hashes, medium]`
//! * `["AllBlocksCleared"]`
//!
//! Newer vLLM appends fields (`lora_name`, `extra_keys`, `group_idx`, …) and may encode an event
//! as a map with a `type` tag instead of an array; both are read, extra fields ignored. A block
//! hash is an integer or (sha256 hashing) bytes; [`EngineHash`] names either by 64 bits.
//! Decoding never panics: every malformed input is a [`DecodeError`].

use rmpv::Value;
use thiserror::Error;

/// The most events one batch may carry, and the most blocks one event may name: far above
/// what one engine step produces, low enough that a garbled length cannot make us allocate
/// without bound.
pub const MAX_EVENTS: usize = 65_536;
pub const MAX_BLOCKS: usize = 65_536;
/// Block sizes a server may use (vLLM: 1..=256 in practice).
pub const MAX_BLOCK_SIZE: u32 = 1024;

/// A server's own name for a block (vLLM's hash of the block's tokens and its parent), by 64
/// bits: the integer itself, or the first 8 bytes' xxh64 for a bytes hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    fn from_value(v: &Value) -> Result<Self, DecodeError> {
        match v {
            Value::Integer(i) => i
                .as_u64()
                .or_else(|| i.as_i64().map(|x| x as u64))
                .map(EngineHash)
                .ok_or(DecodeError::Field("block hash")),
            Value::Binary(b) => Ok(EngineHash(xxhash_rust::xxh64::xxh64(b, 0))),
            _ => Err(DecodeError::Field("block hash")),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored {
        block_hashes: Vec<EngineHash>,
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// One published message's payload.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<Event>,
    pub data_parallel_rank: Option<i64>,
}

/// A whole published message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub topic: String,
    pub seq: u64,
    pub batch: EventBatch,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("expected [topic, sequence, payload], got {0} frames")]
    Frames(usize),
    #[error("the sequence frame has {0} bytes, not 8")]
    Sequence(usize),
    #[error("the batch is not [ts, events, data_parallel_rank]")]
    Batch,
    #[error("unknown event tag {0:?}")]
    UnknownTag(String),
    #[error("malformed {0}")]
    Field(&'static str),
    #[error("{what} has {got} entries, more than {limit}")]
    TooLong {
        what: &'static str,
        got: usize,
        limit: usize,
    },
    #[error("block_size {0} is out of range (1..={MAX_BLOCK_SIZE})")]
    BlockSize(u64),
    #[error(
        "BlockStored names {blocks} blocks of {block_size} tokens but carries {tokens} token ids"
    )]
    TokenCount {
        blocks: usize,
        block_size: u32,
        tokens: usize,
    },
}

fn opt<T>(
    v: Option<&Value>,
    f: impl FnOnce(&Value) -> Result<T, DecodeError>,
) -> Result<Option<T>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => f(v).map(Some),
    }
}

fn list<'a>(v: &'a Value, what: &'static str, limit: usize) -> Result<&'a [Value], DecodeError> {
    let items = v.as_array().ok_or(DecodeError::Field(what))?;
    if items.len() > limit {
        return Err(DecodeError::TooLong {
            what,
            got: items.len(),
            limit,
        });
    }
    Ok(items)
}

fn hashes(v: &Value) -> Result<Vec<EngineHash>, DecodeError> {
    list(v, "block_hashes", MAX_BLOCKS)?
        .iter()
        .map(EngineHash::from_value)
        .collect()
}

fn string(v: &Value) -> Result<String, DecodeError> {
    v.as_str()
        .map(str::to_string)
        .ok_or(DecodeError::Field("medium"))
}

fn int(v: &Value, what: &'static str) -> Result<i64, DecodeError> {
    v.as_i64().ok_or(DecodeError::Field(what))
}

impl Event {
    /// One event, as a tagged array or (newer vLLM) a map with a `type` tag.
    pub fn from_value(v: &Value) -> Result<Event, DecodeError> {
        let (tag, fields): (String, Vec<Option<&Value>>) = match v {
            Value::Array(items) => {
                let tag = items
                    .first()
                    .and_then(Value::as_str)
                    .ok_or(DecodeError::Field("event tag"))?;
                (tag.to_string(), items[1..].iter().map(Some).collect())
            }
            Value::Map(entries) => {
                let get = |key: &str| {
                    entries
                        .iter()
                        .find(|(k, _)| k.as_str() == Some(key))
                        .map(|(_, v)| v)
                };
                let tag = get("type")
                    .and_then(Value::as_str)
                    .ok_or(DecodeError::Field("event tag"))?;
                let names: &[&str] = match tag {
                    "BlockStored" => &[
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "lora_id",
                        "medium",
                    ],
                    "BlockRemoved" => &["block_hashes", "medium"],
                    _ => &[],
                };
                (tag.to_string(), names.iter().map(|n| get(n)).collect())
            }
            _ => return Err(DecodeError::Field("event")),
        };
        let field = |i: usize| fields.get(i).copied().flatten();
        match tag.as_str() {
            "BlockStored" => {
                let block_hashes = hashes(field(0).ok_or(DecodeError::Field("block_hashes"))?)?;
                let parent_block_hash = opt(field(1), EngineHash::from_value)?;
                let token_ids = list(
                    field(2).ok_or(DecodeError::Field("token_ids"))?,
                    "token_ids",
                    MAX_BLOCKS * MAX_BLOCK_SIZE as usize,
                )?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or(DecodeError::Field("token id"))
                })
                .collect::<Result<Vec<u32>, _>>()?;
                let raw_size = field(3)
                    .and_then(Value::as_u64)
                    .ok_or(DecodeError::Field("block_size"))?;
                let block_size = u32::try_from(raw_size)
                    .ok()
                    .filter(|b| (1..=MAX_BLOCK_SIZE).contains(b))
                    .ok_or(DecodeError::BlockSize(raw_size))?;
                if token_ids.len() != block_hashes.len() * block_size as usize {
                    return Err(DecodeError::TokenCount {
                        blocks: block_hashes.len(),
                        block_size,
                        tokens: token_ids.len(),
                    });
                }
                Ok(Event::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: opt(field(4), |v| int(v, "lora_id"))?,
                    medium: opt(field(5), string)?,
                })
            }
            "BlockRemoved" => Ok(Event::BlockRemoved {
                block_hashes: hashes(field(0).ok_or(DecodeError::Field("block_hashes"))?)?,
                medium: opt(field(1), string)?,
            }),
            "AllBlocksCleared" => Ok(Event::AllBlocksCleared),
            other => Err(DecodeError::UnknownTag(other.chars().take(64).collect())),
        }
    }

    /// The tagged-array form vLLM's `array_like` structs produce.
    pub fn to_value(&self) -> Value {
        let hashes = |h: &[EngineHash]| Value::Array(h.iter().map(|h| Value::from(h.0)).collect());
        let opt_str = |m: &Option<String>| m.as_deref().map_or(Value::Nil, Value::from);
        match self {
            Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => Value::Array(vec![
                Value::from("BlockStored"),
                hashes(block_hashes),
                parent_block_hash.map_or(Value::Nil, |h| Value::from(h.0)),
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                Value::from(*block_size),
                lora_id.map_or(Value::Nil, Value::from),
                opt_str(medium),
            ]),
            Event::BlockRemoved {
                block_hashes,
                medium,
            } => Value::Array(vec![
                Value::from("BlockRemoved"),
                hashes(block_hashes),
                opt_str(medium),
            ]),
            Event::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
        }
    }
}

/// A batch whose events decoded one by one: the good ones, and why the others did not.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub batch: EventBatch,
    pub rejected: Vec<DecodeError>,
}

impl EventBatch {
    /// Decodes a payload. A malformed batch is an error; a malformed *event* is set aside in
    /// [`Decoded::rejected`] and the others are kept (one unknown future event type must not
    /// hide the blocks of the rest).
    pub fn decode(payload: &[u8]) -> Result<Decoded, DecodeError> {
        let mut reader = payload;
        let value = rmpv::decode::read_value_with_max_depth(&mut reader, 16)
            .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
        let items = value.as_array().ok_or(DecodeError::Batch)?;
        let ts = items
            .first()
            .and_then(Value::as_f64)
            .ok_or(DecodeError::Batch)?;
        let events = list(
            items.get(1).ok_or(DecodeError::Batch)?,
            "events",
            MAX_EVENTS,
        )?;
        let data_parallel_rank = match items.get(2) {
            None | Some(Value::Nil) => None,
            Some(v) => Some(v.as_i64().ok_or(DecodeError::Batch)?),
        };
        let mut batch = EventBatch {
            ts,
            events: Vec::with_capacity(events.len()),
            data_parallel_rank,
        };
        let mut rejected = Vec::new();
        for e in events {
            match Event::from_value(e) {
                Ok(e) => batch.events.push(e),
                Err(err) => rejected.push(err),
            }
        }
        Ok(Decoded { batch, rejected })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut items = vec![
            Value::F64(self.ts),
            Value::Array(self.events.iter().map(Event::to_value).collect()),
        ];
        if let Some(rank) = self.data_parallel_rank {
            items.push(Value::from(rank));
        }
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &Value::Array(items));
        out
    }
}

impl Message {
    /// The three frames of a published message.
    pub fn encode(&self) -> [Vec<u8>; 3] {
        [
            self.topic.as_bytes().to_vec(),
            self.seq.to_be_bytes().to_vec(),
            self.batch.encode(),
        ]
    }

    /// Reads `[topic, seq, payload]`; the batch's own events as in [`EventBatch::decode`].
    pub fn decode(frames: &[&[u8]]) -> Result<(Message, Vec<DecodeError>), DecodeError> {
        let [topic, seq, payload] = frames else {
            return Err(DecodeError::Frames(frames.len()));
        };
        let seq: [u8; 8] = (*seq)
            .try_into()
            .map_err(|_| DecodeError::Sequence(seq.len()))?;
        let decoded = EventBatch::decode(payload)?;
        Ok((
            Message {
                topic: String::from_utf8_lossy(topic).into_owned(),
                seq: u64::from_be_bytes(seq),
                batch: decoded.batch,
            },
            decoded.rejected,
        ))
    }
}

/// llm-d-inference-sim's topic: `kv@<ip:port>@<model>`.
pub fn topic(address: &str, model: &str) -> String {
    format!("kv@{address}@{model}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> Event {
        Event::BlockStored {
            block_hashes: vec![EngineHash(7), EngineHash(u64::MAX)],
            parent_block_hash: Some(EngineHash(3)),
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
        }
    }

    #[test]
    fn a_message_round_trips_in_vllms_layout() {
        let m = Message {
            topic: topic("127.0.0.1:8000", "m"),
            seq: 42,
            batch: EventBatch {
                ts: 1.5,
                events: vec![
                    stored(),
                    Event::BlockRemoved {
                        block_hashes: vec![EngineHash(7)],
                        medium: None,
                    },
                    Event::AllBlocksCleared,
                ],
                data_parallel_rank: Some(0),
            },
        };
        let frames = m.encode();
        assert_eq!(frames[1], [0, 0, 0, 0, 0, 0, 0, 42]);
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (back, rejected) = Message::decode(&refs).unwrap();
        assert_eq!(back, m);
        assert!(rejected.is_empty());
        // The payload is [ts, [[tag, ...], ...], rank] exactly.
        let mut r = frames[2].as_slice();
        let v = rmpv::decode::read_value(&mut r).unwrap();
        assert_eq!(v[1][0][0].as_str(), Some("BlockStored"));
        assert_eq!(v[1][0].as_array().unwrap().len(), 7);
        assert_eq!(v[1][2].as_array().unwrap().len(), 1);
    }

    #[test]
    fn map_encoded_events_extra_fields_and_bytes_hashes_are_read() {
        let map = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::Binary(vec![1; 32])]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array((0..4).map(Value::from).collect()),
            ),
            (Value::from("block_size"), Value::from(4)),
            (Value::from("lora_name"), Value::Nil),
        ]);
        let Event::BlockStored { block_hashes, .. } = Event::from_value(&map).unwrap() else {
            panic!()
        };
        assert_eq!(
            block_hashes[0],
            EngineHash(xxhash_rust::xxh64::xxh64(&[1; 32], 0))
        );
        let mut longer = stored().to_value();
        if let Value::Array(items) = &mut longer {
            items.push(Value::Nil); // lora_name
            items.push(Value::Array(vec![])); // extra_keys
        }
        assert_eq!(Event::from_value(&longer).unwrap(), stored());
    }

    #[test]
    fn bad_events_are_rejected_one_by_one_and_bad_batches_whole() {
        let batch = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![
                Value::Array(vec![Value::from("BlockEvicted"), Value::Nil]),
                stored().to_value(),
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::from(1)]),
                    Value::Nil,
                    Value::Array(vec![Value::from(1)]),
                    Value::from(1_000_000),
                ]),
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::from(1)]),
                    Value::Nil,
                    Value::Array(vec![Value::from(1), Value::from(2)]),
                    Value::from(4),
                ]),
                Value::from(5),
            ]),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let decoded = EventBatch::decode(&bytes).unwrap();
        assert_eq!(decoded.batch.events, [stored()]);
        assert_eq!(
            decoded.rejected,
            [
                DecodeError::UnknownTag("BlockEvicted".into()),
                DecodeError::BlockSize(1_000_000),
                DecodeError::TokenCount {
                    blocks: 1,
                    block_size: 4,
                    tokens: 2
                },
                DecodeError::Field("event"),
            ]
        );
        for garbage in [
            &b""[..],
            b"\xc1",
            b"\x92\x01",
            b"\xdd\xff\xff\xff\xff",
            b"\x91\xcb",
        ] {
            assert!(EventBatch::decode(garbage).is_err(), "{garbage:?}");
        }
        assert_eq!(
            Message::decode(&[b"t", b"123", b""]).unwrap_err(),
            DecodeError::Sequence(3)
        );
        assert_eq!(
            Message::decode(&[b"t"]).unwrap_err(),
            DecodeError::Frames(1)
        );
    }

    #[test]
    fn a_huge_declared_length_is_refused_without_allocating_it() {
        // An array header claiming 2^32 − 1 events, then nothing.
        let bytes = [
            0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
        ];
        assert!(EventBatch::decode(&bytes).is_err());
    }
}
