//! Raw proxy-wasm ABI 0.2.1 host calls that return the host's status instead of panicking.
//!
//! The SDK's `hostcalls::*` return `Result`, but still `panic!` on any status they do not
//! expect: replacing a request header after the headers were forwarded returns BadArgument,
//! which panics, traps the VM and turns every request on that worker into a 503. Every call
//! the request path makes goes through these wrappers instead. (Callouts still use the SDK's
//! `dispatch_http_call`, because the SDK's dispatcher must register the token to route the
//! response back; Envoy only returns the statuses it handles.)
//!
//! Buffers the host returns are allocated through the SDK's `proxy_on_memory_allocate` (a
//! boxed slice), so they are taken back with `Vec::from_raw_parts(ptr, len, len)`, as the SDK
//! does.

use std::ptr::null_mut;

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};

// The ABI's numbers are the SDK's enums; statuses come back as raw numbers (the host may
// return one the enum does not name), compared against these.
const OK: u32 = Status::Ok as u32;
const NOT_FOUND: u32 = Status::NotFound as u32;
pub const CAS_MISMATCH: u32 = Status::CasMismatch as u32;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// Takes ownership of a host-allocated buffer.
fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host allocated `size` bytes through `proxy_on_memory_allocate`, which
    // returns a leaked boxed slice of exactly that length; ownership passes to us.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

fn status(s: u32) -> Result<(), u32> {
    if s == OK {
        Ok(())
    } else {
        Err(s)
    }
}

pub fn log(level: LogLevel, message: &str) {
    // SAFETY: pointer and length of a live &str.
    unsafe {
        proxy_log(level as u32, message.as_ptr(), message.len());
    }
}

/// Host wall-clock time in milliseconds (0 if the host refuses, which only delays scrapes).
pub fn now_ms() -> u64 {
    let mut ns = 0u64;
    // SAFETY: valid out-pointer.
    let s = unsafe { proxy_get_current_time_nanoseconds(&mut ns) };
    if s == OK {
        ns / 1_000_000
    } else {
        0
    }
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), u32> {
    // SAFETY: plain value.
    status(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Up to `max` bytes of a buffer from `start`; `Ok(None)` when the buffer does not exist.
pub fn get_buffer(
    buffer_type: BufferType,
    start: usize,
    max: usize,
) -> Result<Option<Vec<u8>>, u32> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: valid out-pointers.
    let s = unsafe { proxy_get_buffer_bytes(buffer_type as u32, start, max, &mut data, &mut size) };
    match s {
        OK => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        other => Err(other),
    }
}

/// A header's value as bytes; `Ok(None)` when absent.
pub fn get_header(map_type: MapType, key: &str) -> Result<Option<Vec<u8>>, u32> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: key is a live &str; valid out-pointers.
    let s = unsafe {
        proxy_get_header_map_value(
            map_type as u32,
            key.as_ptr(),
            key.len(),
            &mut data,
            &mut size,
        )
    };
    match s {
        OK => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        other => Err(other),
    }
}

/// A property of the stream (Envoy's attributes), its path's segments joined by NUL bytes as
/// the ABI wants them (`b"upstream\0request_attempt_count"`); `Ok(None)` when the host has no
/// such property (an older Envoy) or no value for it now.
pub fn get_property(path: &[u8]) -> Result<Option<Vec<u8>>, u32> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: path is a live slice; valid out-pointers.
    let s = unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) };
    match s {
        OK => Ok(Some(take(data, size))),
        NOT_FOUND => Ok(None),
        other => Err(other),
    }
}

/// A header's value as text (lossy: header values are bytes). A valid value keeps the host's
/// buffer; only an invalid one is copied.
pub fn get_header_string(map_type: MapType, key: &str) -> Result<Option<String>, u32> {
    Ok(get_header(map_type, key)?.map(|v| {
        String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }))
}

/// Sets a header, replacing every existing value.
pub fn replace_header(map_type: MapType, key: &str, value: &str) -> Result<(), u32> {
    // SAFETY: live &strs.
    status(unsafe {
        proxy_replace_header_map_value(
            map_type as u32,
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn remove_header(map_type: MapType, key: &str) -> Result<(), u32> {
    // SAFETY: live &str.
    status(unsafe { proxy_remove_header_map_value(map_type as u32, key.as_ptr(), key.len()) })
}

pub fn get_shared(key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
    let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
    // SAFETY: live &str; valid out-pointers.
    let s =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match s {
        OK => Ok(Some((take(data, size), cas))),
        NOT_FOUND => Ok(None),
        other => Err(other),
    }
}

pub fn set_shared(key: &str, value: &[u8], cas: u32) -> Result<(), u32> {
    // SAFETY: live slices.
    status(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

pub fn define_metric(metric_type: MetricType, name: &str) -> Result<u32, u32> {
    let mut id = 0u32;
    // SAFETY: live &str; valid out-pointer.
    let s = unsafe { proxy_define_metric(metric_type as u32, name.as_ptr(), name.len(), &mut id) };
    status(s).map(|()| id)
}

pub fn increment_metric(id: u32, offset: i64) -> Result<(), u32> {
    // SAFETY: plain values.
    status(unsafe { proxy_increment_metric(id, offset) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
    // SAFETY: plain values.
    status(unsafe { proxy_record_metric(id, value) })
}
