//! Decoding a `google.protobuf.Struct` from protobuf wire format into JSON.
//!
//! Envoy hands the plugin its `configuration` as the raw bytes of a `StringValue` or
//! `BytesValue`, but for any other message (a `Struct`, which is what YAML users write
//! naturally) it passes the message's *binary* serialisation. This module turns such bytes
//! back into a `serde_json::Value` so that both forms reach core's validation.
//!
//! Schema (google/protobuf/struct.proto): `Struct { map<string, Value> fields = 1; }`,
//! `Value { oneof kind { NullValue null_value = 1; double number_value = 2;
//! string string_value = 3; bool bool_value = 4; Struct struct_value = 5;
//! ListValue list_value = 6; } }`, `ListValue { repeated Value values = 1; }`.

use serde_json::{Map, Number, Value};

/// Nesting deeper than this is refused (a configuration is a few levels deep).
const MAX_DEPTH: usize = 32;

struct Wire<'a> {
    bytes: &'a [u8],
}

enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32,
}

impl<'a> Wire<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.bytes.split_first()?;
            self.bytes = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    fn next(&mut self) -> Option<Option<(u64, Field<'a>)>> {
        if self.bytes.is_empty() {
            return Some(None);
        }
        let key = self.varint()?;
        let field = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => {
                let (head, rest) = split(self.bytes, 8)?;
                self.bytes = rest;
                Field::Fixed64(u64::from_le_bytes(head.try_into().ok()?))
            }
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                let (head, rest) = split(self.bytes, len)?;
                self.bytes = rest;
                Field::Bytes(head)
            }
            5 => {
                self.bytes = self.bytes.get(4..)?;
                Field::Fixed32
            }
            _ => return None,
        };
        Some(Some((key >> 3, field)))
    }
}

fn split(bytes: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (bytes.len() >= n).then(|| bytes.split_at(n))
}

/// Decodes a serialised `google.protobuf.Struct`; `None` if the bytes are not one.
pub fn decode_struct(bytes: &[u8]) -> Option<Value> {
    decode_struct_at(bytes, 0)
}

fn decode_struct_at(bytes: &[u8], depth: usize) -> Option<Value> {
    if depth > MAX_DEPTH {
        return None;
    }
    let mut map = Map::new();
    let mut wire = Wire { bytes };
    while let Some((number, field)) = wire.next()? {
        if let (1, Field::Bytes(entry)) = (number, field) {
            let (key, value) = decode_entry(entry, depth)?;
            map.insert(key, value);
        }
    }
    Some(Value::Object(map))
}

fn decode_entry(bytes: &[u8], depth: usize) -> Option<(String, Value)> {
    let mut wire = Wire { bytes };
    let (mut key, mut value) = (String::new(), Value::Null);
    while let Some((number, field)) = wire.next()? {
        match (number, field) {
            (1, Field::Bytes(k)) => key = String::from_utf8(k.to_vec()).ok()?,
            (2, Field::Bytes(v)) => value = decode_value(v, depth + 1)?,
            _ => {}
        }
    }
    Some((key, value))
}

fn decode_value(bytes: &[u8], depth: usize) -> Option<Value> {
    if depth > MAX_DEPTH {
        return None;
    }
    let mut wire = Wire { bytes };
    let mut value = Value::Null;
    while let Some((number, field)) = wire.next()? {
        value = match (number, field) {
            (1, Field::Varint(_)) => Value::Null,
            (2, Field::Fixed64(bits)) => {
                Number::from_f64(f64::from_bits(bits)).map_or(Value::Null, Value::Number)
            }
            (3, Field::Bytes(s)) => Value::String(String::from_utf8(s.to_vec()).ok()?),
            (4, Field::Varint(b)) => Value::Bool(b != 0),
            (5, Field::Bytes(s)) => decode_struct_at(s, depth + 1)?,
            (6, Field::Bytes(l)) => decode_list(l, depth + 1)?,
            _ => continue,
        };
    }
    Some(value)
}

fn decode_list(bytes: &[u8], depth: usize) -> Option<Value> {
    let mut wire = Wire { bytes };
    let mut items = Vec::new();
    while let Some((number, field)) = wire.next()? {
        if let (1, Field::Bytes(v)) = (number, field) {
            items.push(decode_value(v, depth + 1)?);
        }
    }
    Some(Value::Array(items))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal encoder, the inverse of the decoder, for round-trip tests.
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    fn bytes_field(number: u64, payload: &[u8], out: &mut Vec<u8>) {
        varint(number << 3 | 2, out);
        varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }
    fn encode_value(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        match v {
            Value::Null => {
                varint(1 << 3, &mut out);
                varint(0, &mut out);
            }
            Value::Number(n) => {
                varint(2 << 3 | 1, &mut out);
                out.extend_from_slice(&n.as_f64().unwrap().to_bits().to_le_bytes());
            }
            Value::String(s) => bytes_field(3, s.as_bytes(), &mut out),
            Value::Bool(b) => {
                varint(4 << 3, &mut out);
                varint(u64::from(*b), &mut out);
            }
            Value::Object(_) => bytes_field(5, &encode_struct(v), &mut out),
            Value::Array(items) => {
                let mut list = Vec::new();
                for item in items {
                    bytes_field(1, &encode_value(item), &mut list);
                }
                bytes_field(6, &list, &mut out);
            }
        }
        out
    }
    pub(crate) fn encode_struct(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, item) in v.as_object().unwrap() {
            let mut entry = Vec::new();
            bytes_field(1, k.as_bytes(), &mut entry);
            bytes_field(2, &encode_value(item), &mut entry);
            bytes_field(1, &entry, &mut out);
        }
        out
    }

    #[test]
    fn round_trips_a_configuration() {
        let config = serde_json::json!({
            "endpoints": [{"name": "a", "address": "127.0.0.1:8001"}],
            "policy": "least-queue",
            "block_size": 32.0,
            "weights": {"prefix": 3.5},
            "model": null,
            "flag": true,
            "nested": {"deep": [1.0, "two", [false]]}
        });
        assert_eq!(decode_struct(&encode_struct(&config)), Some(config));
        assert_eq!(decode_struct(&[]), Some(serde_json::json!({})));
    }

    /// Bytes Envoy 1.40 actually passed for the YAML Struct
    /// `{endpoints: [{name: a, address: "127.0.0.1:1"}], block_size: 16, policy: 7}`.
    #[test]
    fn decodes_envoy_bytes() {
        let hex = ENVOY_STRUCT_HEX;
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        assert_eq!(
            decode_struct(&bytes),
            Some(serde_json::json!({
                "endpoints": [{"name": "a", "address": "127.0.0.1:1"}],
                "block_size": 16.0,
                "policy": 7.0
            }))
        );
    }

    const ENVOY_STRUCT_HEX: &str = "0a170a0a626c6f636b5f73697a6512091100000000000030400a3a0a09\
        656e64706f696e7473122d322b0a292a270a180a0761646472657373120d1a0b3132372e302e302e313a31\
        0a0b0a046e616d6512031a01610a130a06706f6c6963791209110000000000001c40";

    #[test]
    fn garbage_is_refused_without_panicking() {
        for bad in [
            &b"{\"endpoints\": []}"[..],
            b"\x0a\xff",
            b"\x0a\x05\x0a\x01",
            b"\x0b",
            &[0xff; 11],
        ] {
            let _ = decode_struct(bad);
        }
        assert_eq!(decode_struct(b"\x0a\x05\x0a\x01"), None, "truncated entry");
        // Deep nesting is bounded.
        let mut v = serde_json::json!(1.0);
        for _ in 0..40 {
            v = serde_json::json!({ "x": v });
        }
        assert_eq!(decode_struct(&encode_struct(&v)), None);
    }
}
