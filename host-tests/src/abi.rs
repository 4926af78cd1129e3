//! Numbers and encodings of proxy-wasm ABI 0.2.1 (spec: proxy-wasm/spec,
//! `abi-versions/v0.2.1/README.md`) and of the WASI preview1 calls a `wasm32-wasip1` cdylib links.

/// `proxy_status_t`. The values are the ABI's, so they are passed to the guest as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    /// Not in the 0.2.1 status list but in Envoy's `WasmResult`: what `proxy_get_status` reports
    /// after a callout failed without a response.
    BrokenConnection = 11,
    Unimplemented = 12,
}

impl Status {
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// `proxy_action_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

impl Action {
    /// Anything but 1 continues, as in Envoy (which only checks for `Pause`).
    pub fn from_raw(raw: i32) -> Action {
        if raw == 1 {
            Action::Pause
        } else {
            Action::Continue
        }
    }
}

/// `proxy_log_level_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub fn from_raw(raw: i32) -> Option<LogLevel> {
        Some(match raw {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

/// `proxy_buffer_type_t`.
pub mod buffer {
    pub const HTTP_REQUEST_BODY: i32 = 0;
    pub const HTTP_RESPONSE_BODY: i32 = 1;
    pub const DOWNSTREAM_DATA: i32 = 2;
    pub const UPSTREAM_DATA: i32 = 3;
    pub const HTTP_CALL_RESPONSE_BODY: i32 = 4;
    pub const GRPC_CALL_MESSAGE: i32 = 5;
    pub const VM_CONFIGURATION: i32 = 6;
    pub const PLUGIN_CONFIGURATION: i32 = 7;
    pub const FOREIGN_FUNCTION_ARGUMENTS: i32 = 8;
}

/// `proxy_map_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapType {
    RequestHeaders = 0,
    RequestTrailers = 1,
    ResponseHeaders = 2,
    ResponseTrailers = 3,
    GrpcInitialMetadata = 4,
    GrpcTrailingMetadata = 5,
    CallResponseHeaders = 6,
    CallResponseTrailers = 7,
}

impl MapType {
    pub fn from_raw(raw: i32) -> Option<MapType> {
        Some(match raw {
            0 => MapType::RequestHeaders,
            1 => MapType::RequestTrailers,
            2 => MapType::ResponseHeaders,
            3 => MapType::ResponseTrailers,
            4 => MapType::GrpcInitialMetadata,
            5 => MapType::GrpcTrailingMetadata,
            6 => MapType::CallResponseHeaders,
            7 => MapType::CallResponseTrailers,
            _ => return None,
        })
    }
}

/// `proxy_stream_type_t`.
pub mod stream {
    pub const HTTP_REQUEST: i32 = 0;
    pub const HTTP_RESPONSE: i32 = 1;
}

/// `proxy_metric_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

impl MetricKind {
    pub fn from_raw(raw: i32) -> Option<MetricKind> {
        Some(match raw {
            0 => MetricKind::Counter,
            1 => MetricKind::Gauge,
            2 => MetricKind::Histogram,
            _ => return None,
        })
    }
}

/// `wasi_errno_t` values the host returns.
pub mod errno {
    pub const SUCCESS: i32 = 0;
    pub const BADF: i32 = 8;
    pub const FAULT: i32 = 21;
    pub const INVAL: i32 = 28;
    /// What a WASI call the host does not implement returns.
    pub const NOSYS: i32 = 52;
    pub const NOTSUP: i32 = 58;
}

/// An HTTP field map as Envoy keeps it: ordered, keys lower-case, repeated keys allowed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    pairs: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for Headers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.pairs
                    .iter()
                    .map(|(k, v)| format!("{k}: {}", String::from_utf8_lossy(v))),
            )
            .finish()
    }
}

impl Headers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a map from pairs; keys are lower-cased as Envoy does on the way in.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let mut h = Headers::new();
        for (k, v) in pairs {
            h.add(k.as_ref(), v.as_ref());
        }
        h
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    pub fn pairs(&self) -> &[(String, Vec<u8>)] {
        &self.pairs
    }

    /// The first value of `key` (Envoy's `proxy_get_header_map_value` also returns the first).
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        let key = key.to_ascii_lowercase();
        self.pairs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_slice())
    }

    pub fn get_str(&self, key: &str) -> Option<String> {
        self.get(key)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// Every value of `key`, in order.
    pub fn get_all(&self, key: &str) -> Vec<&[u8]> {
        let key = key.to_ascii_lowercase();
        self.pairs
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    pub fn add(&mut self, key: &str, value: &[u8]) {
        self.pairs.push((key.to_ascii_lowercase(), value.to_vec()));
    }

    /// Replaces every value of `key` by one (adds it when absent).
    pub fn replace(&mut self, key: &str, value: &[u8]) {
        let key = key.to_ascii_lowercase();
        match self.pairs.iter().position(|(k, _)| *k == key) {
            Some(first) => {
                self.pairs[first].1 = value.to_vec();
                let mut i = 0;
                self.pairs.retain(|(k, _)| {
                    i += 1;
                    i - 1 == first || *k != key
                });
            }
            None => self.pairs.push((key, value.to_vec())),
        }
    }

    pub fn remove(&mut self, key: &str) {
        let key = key.to_ascii_lowercase();
        self.pairs.retain(|(k, _)| *k != key);
    }

    /// The ABI's serialisation: `count u32 | count × (key_len u32, value_len u32) |
    /// key \0 value \0 …`, little-endian. An empty map is empty bytes.
    pub fn serialize(&self) -> Vec<u8> {
        if self.pairs.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        out.extend_from_slice(&(self.pairs.len() as u32).to_le_bytes());
        for (k, v) in &self.pairs {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (k, v) in &self.pairs {
            out.extend_from_slice(k.as_bytes());
            out.push(0);
            out.extend_from_slice(v);
            out.push(0);
        }
        out
    }

    /// Parses the ABI's serialisation; `None` when it is malformed (lengths past the end, a
    /// missing NUL, a key that is not UTF-8). Empty bytes and a single 0 byte are the empty map.
    pub fn deserialize(bytes: &[u8]) -> Option<Headers> {
        if bytes.is_empty() || bytes == [0] {
            return Some(Headers::new());
        }
        let word = |at: usize| -> Option<usize> {
            let b = bytes.get(at..at.checked_add(4)?)?;
            Some(u32::from_le_bytes(b.try_into().ok()?) as usize)
        };
        let count = word(0)?;
        let mut data = count.checked_mul(8)?.checked_add(4)?;
        if data > bytes.len() {
            return None;
        }
        let mut headers = Headers::new();
        for i in 0..count {
            let (klen, vlen) = (word(4 + i * 8)?, word(8 + i * 8)?);
            let key = bytes.get(data..data.checked_add(klen)?)?;
            data += klen;
            if bytes.get(data) != Some(&0) {
                return None;
            }
            data += 1;
            let value = bytes.get(data..data.checked_add(vlen)?)?;
            data += vlen;
            if bytes.get(data) != Some(&0) {
                return None;
            }
            data += 1;
            headers.add(std::str::from_utf8(key).ok()?, value);
        }
        Some(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialisation_matches_the_spec_example_and_round_trips() {
        // The spec's example: {"a": "1"}, {"b": "22"}.
        let h = Headers::from_pairs([("a", "1"), ("b", "22")]);
        let bytes = h.serialize();
        let mut expected = vec![2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0];
        expected.extend_from_slice(b"a\x001\x00b\x0022\x00");
        assert_eq!(bytes, expected);
        assert_eq!(Headers::deserialize(&bytes), Some(h));
        assert_eq!(Headers::deserialize(&[]), Some(Headers::new()));
        assert_eq!(Headers::deserialize(&[0]), Some(Headers::new()));
        for cut in 1..expected.len() {
            assert_eq!(Headers::deserialize(&expected[..cut]), None, "cut at {cut}");
        }
        // A count that claims more pairs than there are bytes.
        assert_eq!(Headers::deserialize(&[255, 255, 255, 255]), None);
    }

    #[test]
    fn replace_keeps_one_value_and_keys_are_lower_case() {
        let mut h = Headers::from_pairs([("X-Dest", "a"), ("other", "o"), ("x-dest", "b")]);
        assert_eq!(h.get_all("x-dest"), vec![&b"a"[..], &b"b"[..]]);
        h.replace("X-DEST", b"c");
        assert_eq!(h.get_all("x-dest"), vec![&b"c"[..]]);
        assert_eq!(h.len(), 2);
        h.remove("x-dest");
        assert_eq!(h.get("x-dest"), None);
        h.replace("new", b"n");
        assert_eq!(h.get_str("NEW").as_deref(), Some("n"));
    }
}
