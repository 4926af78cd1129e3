//! Numbers and encodings of proxy-wasm ABI 0.2.1 (spec: proxy-wasm/spec,
//! `abi-versions/v0.2.1/README.md`) and of the WASI preview1 calls a `wasm32-wasip1` cdylib links.

use proxy_wasm::types as sdk;

// The numbers are the proxy-wasm Rust SDK's (`proxy_wasm::types`), the same enums the plugin
// is built against, so the host and the guest cannot disagree on one of them. The host keeps its
// own enums for the values the SDK does not name and for the traits the harness needs.

/// `from_raw` for an ABI enum: the variant whose number the guest passed, if any.
macro_rules! from_raw {
    ($ty:ident: $($variant:ident),+ $(,)?) => {
        impl $ty {
            pub fn from_raw(raw: i32) -> Option<$ty> {
                [$($ty::$variant),+].into_iter().find(|&v| v as i32 == raw)
            }
        }
    };
}

/// `proxy_status_t`. The values are the ABI's, so they are passed to the guest as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum Status {
    Ok = sdk::Status::Ok as u32,
    NotFound = sdk::Status::NotFound as u32,
    BadArgument = sdk::Status::BadArgument as u32,
    SerializationFailure = sdk::Status::SerializationFailure as u32,
    ParseFailure = sdk::Status::ParseFailure as u32,
    /// In the 0.2.1 status list, not in the SDK's enum.
    InvalidMemoryAccess = 6,
    Empty = sdk::Status::Empty as u32,
    CasMismatch = sdk::Status::CasMismatch as u32,
    InternalFailure = sdk::Status::InternalFailure as u32,
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
    /// Anything but `Pause` continues, as in Envoy (which only checks for `Pause`).
    pub fn from_raw(raw: i32) -> Action {
        if raw == sdk::Action::Pause as i32 {
            Action::Pause
        } else {
            Action::Continue
        }
    }
}

/// `proxy_log_level_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Trace = sdk::LogLevel::Trace as isize,
    Debug = sdk::LogLevel::Debug as isize,
    Info = sdk::LogLevel::Info as isize,
    Warn = sdk::LogLevel::Warn as isize,
    Error = sdk::LogLevel::Error as isize,
    Critical = sdk::LogLevel::Critical as isize,
}

from_raw!(LogLevel: Trace, Debug, Info, Warn, Error, Critical);

/// `proxy_buffer_type_t`.
pub mod buffer {
    use proxy_wasm::types::BufferType;

    pub const HTTP_REQUEST_BODY: i32 = BufferType::HttpRequestBody as i32;
    pub const HTTP_RESPONSE_BODY: i32 = BufferType::HttpResponseBody as i32;
    pub const DOWNSTREAM_DATA: i32 = BufferType::DownstreamData as i32;
    pub const UPSTREAM_DATA: i32 = BufferType::UpstreamData as i32;
    pub const HTTP_CALL_RESPONSE_BODY: i32 = BufferType::HttpCallResponseBody as i32;
    pub const GRPC_CALL_MESSAGE: i32 = BufferType::GrpcReceiveBuffer as i32;
    pub const VM_CONFIGURATION: i32 = BufferType::VmConfiguration as i32;
    pub const PLUGIN_CONFIGURATION: i32 = BufferType::PluginConfiguration as i32;
    pub const FOREIGN_FUNCTION_ARGUMENTS: i32 = BufferType::CallData as i32;
}

/// `proxy_map_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapType {
    RequestHeaders = sdk::MapType::HttpRequestHeaders as isize,
    RequestTrailers = sdk::MapType::HttpRequestTrailers as isize,
    ResponseHeaders = sdk::MapType::HttpResponseHeaders as isize,
    ResponseTrailers = sdk::MapType::HttpResponseTrailers as isize,
    GrpcInitialMetadata = sdk::MapType::GrpcReceiveInitialMetadata as isize,
    GrpcTrailingMetadata = sdk::MapType::GrpcReceiveTrailingMetadata as isize,
    CallResponseHeaders = sdk::MapType::HttpCallResponseHeaders as isize,
    CallResponseTrailers = sdk::MapType::HttpCallResponseTrailers as isize,
}

from_raw!(
    MapType: RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    CallResponseHeaders,
    CallResponseTrailers,
);

/// `proxy_stream_type_t`.
pub mod stream {
    use proxy_wasm::types::StreamType;

    pub const HTTP_REQUEST: i32 = StreamType::HttpRequest as i32;
    pub const HTTP_RESPONSE: i32 = StreamType::HttpResponse as i32;
}

/// `proxy_metric_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetricKind {
    Counter = sdk::MetricType::Counter as isize,
    Gauge = sdk::MetricType::Gauge as isize,
    Histogram = sdk::MetricType::Histogram as isize,
}

from_raw!(MetricKind: Counter, Gauge, Histogram);

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
