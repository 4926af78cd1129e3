//! The host functions: every `env.proxy_*` import of ABI 0.2.1 and the WASI preview1 calls a
//! `wasm32-wasip1` cdylib links, plus a stub for any other import the module declares in those
//! two modules (it returns `Unimplemented` / `ENOSYS` and is recorded), so a module never fails
//! to link because it *links* something it does not *use* (the proxy-wasm SDK links all of
//! gRPC, queues and properties).

use wasmtime::{Caller, ExternType, Linker, Module, Val, ValType};

use crate::abi::{buffer, errno, stream, Headers, LogLevel, MapType, MetricKind, Status};
use crate::capture::{
    Callout, HeaderOp, HeaderOpKind, LocalReply, LogLine, MetricOp, MetricOpKind,
};
use crate::costs::ALLOCATE;
use crate::state::{StreamState, VmState};

type C<'a> = Caller<'a, VmState>;
type Ret = wasmtime::Result<i32>;

const ENV: &str = "env";
const WASI: &str = "wasi_snapshot_preview1";

fn ok() -> Ret {
    Ok(Status::Ok.code())
}

fn st(s: Status) -> Ret {
    Ok(s.code())
}

/// Guest memory range `[ptr, ptr+len)` copied out, counted as bytes out.
fn read(c: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let memory = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let (p, l) = (ptr as u32 as usize, len as u32 as usize);
    let bytes = memory
        .data(&*c)
        .get(p..p.checked_add(l).ok_or(Status::InvalidMemoryAccess)?)
        .ok_or(Status::InvalidMemoryAccess)?
        .to_vec();
    c.data_mut().running.bytes_out += l as u64;
    Ok(bytes)
}

fn read_str(c: &mut C<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    let bytes = read(c, ptr, len)?;
    String::from_utf8(bytes).map_err(|_| Status::BadArgument)
}

fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
    let memory = c.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let p = ptr as u32 as usize;
    memory
        .data_mut(&mut *c)
        .get_mut(
            p..p.checked_add(bytes.len())
                .ok_or(Status::InvalidMemoryAccess)?,
        )
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

fn write_u64(c: &mut C<'_>, ptr: i32, v: u64) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

/// Hands `bytes` to the guest the way Envoy does: allocate with the guest's
/// `proxy_on_memory_allocate`, copy, and write pointer and size to the return slots. An empty
/// value is a null pointer and size 0, without an allocation. A trap in the allocator is
/// returned as a trap.
fn give(c: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> wasmtime::Result<Status> {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let Some(allocate) = c.data().allocate.clone() else {
            return Ok(Status::InvalidMemoryAccess);
        };
        c.data_mut().count(ALLOCATE);
        ptr = allocate.call(&mut *c, bytes.len() as i32)? as u32;
        if ptr == 0 {
            return Ok(Status::InvalidMemoryAccess);
        }
        if let Err(s) = write(c, ptr as i32, bytes) {
            return Ok(s);
        }
        c.data_mut().running.bytes_in += bytes.len() as u64;
    }
    if let Err(s) =
        write_u32(c, ptr_ptr, ptr).and_then(|()| write_u32(c, size_ptr, bytes.len() as u32))
    {
        return Ok(s);
    }
    Ok(Status::Ok)
}

/// Unwraps a guest-memory result inside a host function returning a status.
macro_rules! try_status {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(s) => return st(s),
        }
    };
}

fn log(c: &mut C<'_>, level: LogLevel, message: String) {
    let context_id = c.data().context_id();
    c.data_mut().capture.logs.push(LogLine {
        level,
        context_id,
        message,
    });
}

/// The stream of the effective context, if that context is an HTTP stream.
fn stream_mut<'a>(c: &'a mut C<'_>) -> Option<&'a mut StreamState> {
    let id = c.data().effective_context;
    c.data_mut().streams.get_mut(&id).filter(|s| !s.deleted)
}

/// Whether the effective context may read (`write = false`) or write a map now. Mirrors
/// Envoy's filter: request headers exist from `on_request_headers` until they are forwarded
/// (held while the guest paused), and are read-only in `on_log`; response headers likewise;
/// callout response headers only inside `on_http_call_response`.
fn map_access(c: &mut C<'_>, map: MapType, write: bool) -> Result<(), Status> {
    let callback = c.data().callback();
    let in_call_response = c.data().call_response.is_some();
    let logging = callback == "proxy_on_log";
    match map {
        MapType::CallResponseHeaders | MapType::CallResponseTrailers => {
            if in_call_response && !write {
                Ok(())
            } else {
                Err(Status::BadArgument)
            }
        }
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => Err(Status::BadArgument),
        _ => {
            let s = stream_mut(c).ok_or(Status::BadArgument)?;
            let live = match map {
                MapType::RequestHeaders => {
                    s.upstream_headers.is_none()
                        && (s.request_headers_held || callback == "proxy_on_request_headers")
                }
                MapType::RequestTrailers => {
                    s.request_trailers_received && s.upstream_trailers.is_none()
                }
                MapType::ResponseHeaders => {
                    s.downstream_headers.is_none()
                        && (s.response_headers_held || callback == "proxy_on_response_headers")
                }
                MapType::ResponseTrailers => s.response_trailers_received,
                _ => false,
            };
            if live || (logging && !write) {
                Ok(())
            } else {
                Err(Status::BadArgument)
            }
        }
    }
}

fn map_ref<'a>(c: &'a mut C<'_>, map: MapType) -> Option<&'a mut Headers> {
    if let MapType::CallResponseHeaders | MapType::CallResponseTrailers = map {
        let r = c.data_mut().call_response.as_mut()?;
        return Some(if map == MapType::CallResponseHeaders {
            &mut r.headers
        } else {
            &mut r.trailers
        });
    }
    let s = stream_mut(c)?;
    Some(match map {
        MapType::RequestHeaders => &mut s.request_headers,
        MapType::RequestTrailers => &mut s.request_trailers,
        MapType::ResponseHeaders => &mut s.response_headers,
        MapType::ResponseTrailers => &mut s.response_trailers,
        _ => return None,
    })
}

fn record_header_op(
    c: &mut C<'_>,
    map: MapType,
    kind: HeaderOpKind,
    key: String,
    value: Vec<u8>,
    status: Status,
) {
    let context_id = c.data().context_id();
    c.data_mut().capture.header_ops.push(HeaderOp {
        context_id,
        map,
        kind,
        key,
        value,
        status,
    });
}

/// A header write: checks access, applies `edit`, records the operation.
fn edit_map(
    c: &mut C<'_>,
    map: i32,
    kind: HeaderOpKind,
    key: String,
    value: Vec<u8>,
    edit: impl FnOnce(&mut Headers),
) -> Ret {
    let Some(map) = MapType::from_raw(map) else {
        return st(Status::BadArgument);
    };
    let status = match map_access(c, map, true) {
        Ok(()) => match map_ref(c, map) {
            Some(h) => {
                edit(h);
                Status::Ok
            }
            None => Status::BadArgument,
        },
        Err(s) => s,
    };
    record_header_op(c, map, kind, key, value, status);
    st(status)
}

/// The bytes of a buffer as the effective context sees it now, or the status to return.
fn buffer_bytes(c: &mut C<'_>, kind: i32) -> Result<Vec<u8>, Status> {
    let s = c.data();
    match kind {
        buffer::PLUGIN_CONFIGURATION => Ok(s.plugin_configuration.clone()),
        buffer::VM_CONFIGURATION => Ok(s.vm_configuration.clone()),
        buffer::HTTP_CALL_RESPONSE_BODY => s
            .call_response
            .as_ref()
            .map(|r| r.body.clone())
            .ok_or(Status::NotFound),
        buffer::HTTP_REQUEST_BODY | buffer::HTTP_RESPONSE_BODY => {
            let request = kind == buffer::HTTP_REQUEST_BODY;
            let s = stream_mut(c).ok_or(Status::NotFound)?;
            let body = if request {
                &s.request_body
            } else {
                &s.response_body
            };
            // Envoy has no buffer once the body went on (the guest returned Continue).
            if body.is_empty() {
                Err(Status::NotFound)
            } else {
                Ok(body.clone())
            }
        }
        buffer::DOWNSTREAM_DATA
        | buffer::UPSTREAM_DATA
        | buffer::GRPC_CALL_MESSAGE
        | buffer::FOREIGN_FUNCTION_ARGUMENTS => Err(Status::NotFound),
        _ => Err(Status::BadArgument),
    }
}

/// Records an unimplemented call and answers `status`.
fn unimplemented(c: &mut C<'_>, module: &str, name: &str) {
    c.data_mut().count(name);
    c.data_mut()
        .capture
        .unimplemented
        .push((module.to_string(), name.to_string()));
}

/// Stubs for every import of `env` and `wasi_snapshot_preview1` the module declares. The real
/// implementations are defined afterwards and shadow these; what is left answers
/// `Unimplemented` (proxy-wasm) or `ENOSYS` (WASI) instead of failing to link.
fn define_stubs(linker: &mut Linker<VmState>, module: &Module) -> wasmtime::Result<()> {
    for import in module.imports() {
        let (m, name) = (import.module().to_string(), import.name().to_string());
        if m != ENV && m != WASI {
            continue;
        }
        let ExternType::Func(ty) = import.ty() else {
            continue;
        };
        let code = if m == ENV {
            Status::Unimplemented.code()
        } else {
            errno::NOSYS
        };
        let result_types: Vec<ValType> = ty.results().collect();
        linker.func_new(
            &m.clone(),
            &name.clone(),
            ty,
            move |mut c, _params, results| {
                unimplemented(&mut c, &m, &name);
                for (i, (slot, t)) in results.iter_mut().zip(&result_types).enumerate() {
                    *slot = match t {
                        ValType::I32 => Val::I32(if i == 0 { code } else { 0 }),
                        ValType::I64 => Val::I64(0),
                        ValType::F32 => Val::F32(0),
                        ValType::F64 => Val::F64(0),
                        _ => Val::null_func_ref(),
                    };
                }
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// Builds the linker for `module`: stubs first, then every implemented host function.
pub(crate) fn linker(module: &Module) -> wasmtime::Result<Linker<VmState>> {
    let mut l = Linker::new(module.engine());
    l.allow_shadowing(true);
    define_stubs(&mut l, module)?;
    define_proxy(&mut l)?;
    define_execution_log(&mut l)?;
    define_unimplemented_proxy(&mut l)?;
    define_wasi(&mut l)?;
    Ok(l)
}

/// `env.log_execution(id)`, which binaryen's `wasm-opt --log-execution` calls at every
/// function's entry and loop's head: the fuel left there, while a recording is on (see
/// `examples/profile.rs`). Not a proxy-wasm import; a module without it never calls it.
fn define_execution_log(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    l.func_wrap("env", "log_execution", |mut c: C<'_>, id: i32| {
        let fuel = c.get_fuel().unwrap_or(0);
        if let Some(log) = c.data_mut().execution.as_mut() {
            log.push((id as u32, fuel));
        }
    })?;
    Ok(())
}

fn define_proxy(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    l.func_wrap(
        ENV,
        "proxy_log",
        |mut c: C<'_>, level: i32, ptr: i32, len: i32| -> Ret {
            c.data_mut().count("proxy_log");
            let Some(level) = LogLevel::from_raw(level) else {
                return st(Status::BadArgument);
            };
            let bytes = try_status!(read(&mut c, ptr, len));
            log(&mut c, level, String::from_utf8_lossy(&bytes).into_owned());
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_log_level",
        |mut c: C<'_>, ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_log_level");
            let level = c.data().options.log_level as u32;
            try_status!(write_u32(&mut c, ptr, level));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_current_time_nanoseconds");
            let now = c.data().clock.now_ns();
            try_status!(write_u64(&mut c, ptr, now));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, period: i32| -> Ret {
            c.data_mut().count("proxy_set_tick_period_milliseconds");
            let s = c.data_mut();
            // Ticks belong to root contexts; a stream context cannot set one.
            if s.effective_context != s.root_context_id {
                return st(Status::BadArgument);
            }
            s.tick_period_ms = period as u32;
            s.capture.tick_periods.push(period as u32);
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>, kind: i32, start: i32, max: i32, ptr_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_buffer_bytes");
            let bytes = try_status!(buffer_bytes(&mut c, kind));
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            if start.checked_add(max).is_none() || start > bytes.len() {
                return st(Status::BadArgument);
            }
            let end = (start + max).min(bytes.len());
            // Like Envoy, nothing at all is written back for an empty range.
            if end == start {
                return ok();
            }
            Ok(give(&mut c, &bytes[start..end], ptr_ptr, size_ptr)?.code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: C<'_>, kind: i32, start: i32, size: i32, ptr: i32, len: i32| -> Ret {
            c.data_mut().count("proxy_set_buffer_bytes");
            let value = try_status!(read(&mut c, ptr, len));
            let request = match kind {
                buffer::HTTP_REQUEST_BODY => true,
                buffer::HTTP_RESPONSE_BODY => false,
                2..=8 => return st(Status::NotFound),
                _ => return st(Status::BadArgument),
            };
            let Some(s) = stream_mut(&mut c) else {
                return st(Status::NotFound);
            };
            let body = if request {
                &mut s.request_body
            } else {
                &mut s.response_body
            };
            // prepend (start 0, size 0), append (start >= len), replace (start < len).
            let start = (start as u32 as usize).min(body.len());
            let end = start.saturating_add(size as u32 as usize).min(body.len());
            body.splice(start..end, value);
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_buffer_status",
        |mut c: C<'_>, kind: i32, size_ptr: i32, flags_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_buffer_status");
            let bytes = try_status!(buffer_bytes(&mut c, kind));
            try_status!(write_u32(&mut c, size_ptr, bytes.len() as u32));
            try_status!(write_u32(&mut c, flags_ptr, 0));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_size",
        |mut c: C<'_>, map: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_header_map_size");
            let map = try_status!(MapType::from_raw(map).ok_or(Status::BadArgument));
            try_status!(map_access(&mut c, map, false));
            let size = map_ref(&mut c, map).map_or(0, |h| h.serialize().len());
            try_status!(write_u32(&mut c, size_ptr, size as u32));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, map: i32, ptr_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_header_map_pairs");
            let map = try_status!(MapType::from_raw(map).ok_or(Status::BadArgument));
            try_status!(map_access(&mut c, map, false));
            let bytes = map_ref(&mut c, map)
                .map(|h| h.serialize())
                .unwrap_or_default();
            Ok(give(&mut c, &bytes, ptr_ptr, size_ptr)?.code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_header_map_pairs",
        |mut c: C<'_>, map: i32, ptr: i32, len: i32| -> Ret {
            c.data_mut().count("proxy_set_header_map_pairs");
            let bytes = try_status!(read(&mut c, ptr, len));
            let Some(pairs) = Headers::deserialize(&bytes) else {
                return st(Status::BadArgument);
            };
            edit_map(
                &mut c,
                map,
                HeaderOpKind::SetPairs,
                String::new(),
                bytes,
                |h| *h = pairs,
            )
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: C<'_>, map: i32, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_header_map_value");
            let map = try_status!(MapType::from_raw(map).ok_or(Status::BadArgument));
            let key = try_status!(read_str(&mut c, kptr, klen));
            try_status!(map_access(&mut c, map, false));
            let Some(value) = map_ref(&mut c, map).and_then(|h| h.get(&key).map(<[u8]>::to_vec))
            else {
                return st(Status::NotFound);
            };
            Ok(give(&mut c, &value, ptr_ptr, size_ptr)?.code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: C<'_>, map: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| -> Ret {
            c.data_mut().count("proxy_add_header_map_value");
            let key = try_status!(read_str(&mut c, kptr, klen));
            let value = try_status!(read(&mut c, vptr, vlen));
            let (k, v) = (key.clone(), value.clone());
            edit_map(&mut c, map, HeaderOpKind::Add, key, value, move |h| {
                h.add(&k, &v)
            })
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, map: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| -> Ret {
            c.data_mut().count("proxy_replace_header_map_value");
            let key = try_status!(read_str(&mut c, kptr, klen));
            let value = try_status!(read(&mut c, vptr, vlen));
            let (k, v) = (key.clone(), value.clone());
            edit_map(&mut c, map, HeaderOpKind::Replace, key, value, move |h| {
                h.replace(&k, &v)
            })
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, map: i32, kptr: i32, klen: i32| -> Ret {
            c.data_mut().count("proxy_remove_header_map_value");
            let key = try_status!(read_str(&mut c, kptr, klen));
            let k = key.clone();
            edit_map(
                &mut c,
                map,
                HeaderOpKind::Remove,
                key,
                Vec::new(),
                move |h| h.remove(&k),
            )
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_continue_stream",
        |mut c: C<'_>, kind: i32| -> Ret {
            c.data_mut().count("proxy_continue_stream");
            let context_id = c.data().effective_context;
            c.data_mut().capture.continues.push((context_id, kind));
            let Some(s) = stream_mut(&mut c) else {
                return st(Status::BadArgument);
            };
            match kind {
                stream::HTTP_REQUEST => {
                    if s.request_headers_held {
                        s.forward_request();
                    }
                }
                stream::HTTP_RESPONSE => {
                    if s.response_headers_held {
                        s.forward_response();
                    }
                }
                2 | 3 => return st(Status::Unimplemented),
                _ => return st(Status::BadArgument),
            }
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_close_stream",
        |mut c: C<'_>, kind: i32| -> Ret {
            c.data_mut().count("proxy_close_stream");
            let context_id = c.data().effective_context;
            c.data_mut().capture.closes.push((context_id, kind));
            if !(0..=3).contains(&kind) {
                return st(Status::BadArgument);
            }
            match stream_mut(&mut c) {
                Some(s) => {
                    s.closed = true;
                    ok()
                }
                None => st(Status::BadArgument),
            }
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_status",
        |mut c: C<'_>, code_ptr: i32, msg_ptr_ptr: i32, msg_size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_status");
            let (code, message) = c.data().status.clone();
            try_status!(write_u32(&mut c, code_ptr, code));
            Ok(give(&mut c, message.as_bytes(), msg_ptr_ptr, msg_size_ptr)?.code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: C<'_>,
         code: i32,
         dptr: i32,
         dlen: i32,
         bptr: i32,
         blen: i32,
         hptr: i32,
         hlen: i32,
         grpc: i32|
         -> Ret {
            c.data_mut().count("proxy_send_local_response");
            let details = try_status!(read(&mut c, dptr, dlen));
            let body = try_status!(read(&mut c, bptr, blen));
            let raw_headers = try_status!(read(&mut c, hptr, hlen));
            let Some(headers) = Headers::deserialize(&raw_headers) else {
                return st(Status::BadArgument);
            };
            let context_id = c.data().effective_context;
            let reply = LocalReply {
                context_id,
                status_code: code as u32,
                details: String::from_utf8_lossy(&details).into_owned(),
                body,
                headers,
                grpc_status: grpc,
            };
            c.data_mut().capture.local_replies.push(reply.clone());
            match stream_mut(&mut c) {
                // Only before the response started, as in Envoy.
                Some(s) if s.downstream_headers.is_none() => {
                    s.local_reply = Some(reply);
                    ok()
                }
                _ => st(Status::BadArgument),
            }
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_http_call",
        |mut c: C<'_>,
         uptr: i32,
         ulen: i32,
         hptr: i32,
         hlen: i32,
         bptr: i32,
         blen: i32,
         tptr: i32,
         tlen: i32,
         timeout: i32,
         token_ptr: i32|
         -> Ret {
            c.data_mut().count("proxy_http_call");
            let cluster = try_status!(read_str(&mut c, uptr, ulen));
            let raw_headers = try_status!(read(&mut c, hptr, hlen));
            let body = try_status!(read(&mut c, bptr, blen));
            let raw_trailers = try_status!(read(&mut c, tptr, tlen));
            let (Some(headers), Some(trailers)) = (
                Headers::deserialize(&raw_headers),
                Headers::deserialize(&raw_trailers),
            ) else {
                return st(Status::BadArgument);
            };
            // Envoy: the cluster must exist, and the request needs :method, :path, :authority.
            if !c.data().options.clusters.contains(&cluster)
                || [":method", ":path", ":authority"]
                    .iter()
                    .any(|h| headers.get(h).is_none())
            {
                return st(Status::BadArgument);
            }
            let token = c.data().next_token();
            try_status!(write_u32(&mut c, token_ptr, token));
            let s = c.data_mut();
            let callout = Callout {
                token,
                context_id: s.effective_context,
                cluster,
                headers,
                body,
                trailers,
                timeout_ms: timeout as u32,
                sent_at_ms: s.clock.now_ms(),
                answered: false,
            };
            s.capture.callouts.push(callout);
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: C<'_>, kptr: i32, klen: i32, vptr: i32, vlen: i32, cas: i32| -> Ret {
            c.data_mut().count("proxy_set_shared_data");
            let key = try_status!(read(&mut c, kptr, klen));
            let value = try_status!(read(&mut c, vptr, vlen));
            let s = c.data_mut();
            s.running.shared_bytes_out += value.len() as u64;
            st(s.shared.set(&s.vm_id, &key, &value, cas as u32))
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: C<'_>, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32, cas_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_shared_data");
            let key = try_status!(read(&mut c, kptr, klen));
            let found = {
                let s = c.data();
                s.shared.get(&s.vm_id, &key)
            };
            let Some((value, cas)) = found else {
                return st(Status::NotFound);
            };
            c.data_mut().running.shared_bytes_in += value.len() as u64;
            let status = give(&mut c, &value, ptr_ptr, size_ptr)?;
            if status != Status::Ok {
                return st(status);
            }
            try_status!(write_u32(&mut c, cas_ptr, cas));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: C<'_>, kind: i32, nptr: i32, nlen: i32, id_ptr: i32| -> Ret {
            c.data_mut().count("proxy_define_metric");
            let name = try_status!(read_str(&mut c, nptr, nlen));
            let context_id = c.data().context_id();
            let Some(kind) = MetricKind::from_raw(kind) else {
                return st(Status::BadArgument);
            };
            let s = c.data_mut();
            // Envoy: a fresh id per definition, the kind in its low bits.
            let id = (s.next_metric << 2) | kind as u32;
            s.next_metric += 1;
            s.metric_ids.insert(id, (kind, name.clone()));
            s.stats.define(kind, &name);
            s.capture.metric_ops.push(MetricOp {
                context_id,
                name,
                kind: MetricOpKind::Define(kind),
                status: Status::Ok,
            });
            try_status!(write_u32(&mut c, id_ptr, id));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_increment_metric",
        |mut c: C<'_>, id: i32, delta: i64| -> Ret {
            c.data_mut().count("proxy_increment_metric");
            metric_op(&mut c, id as u32, MetricOpKind::Increment(delta))
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_record_metric",
        |mut c: C<'_>, id: i32, value: i64| -> Ret {
            c.data_mut().count("proxy_record_metric");
            metric_op(&mut c, id as u32, MetricOpKind::Record(value as u64))
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_metric",
        |mut c: C<'_>, id: i32, ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_metric");
            let Some((_, name)) = c.data().metric_ids.get(&(id as u32)).cloned() else {
                return st(Status::NotFound);
            };
            let value = c.data().stats.value(&name);
            try_status!(write_u64(&mut c, ptr, value as u64));
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: C<'_>, pptr: i32, plen: i32, ptr_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("proxy_get_property");
            let path = try_status!(read(&mut c, pptr, plen));
            let stream = stream_mut(&mut c).and_then(|s| s.properties.get(&path).cloned());
            let Some(value) = stream.or_else(|| c.data().properties.get(&path).cloned()) else {
                return st(Status::NotFound);
            };
            Ok(give(&mut c, &value, ptr_ptr, size_ptr)?.code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_property",
        |mut c: C<'_>, pptr: i32, plen: i32, vptr: i32, vlen: i32| -> Ret {
            c.data_mut().count("proxy_set_property");
            let path = try_status!(read(&mut c, pptr, plen));
            let value = try_status!(read(&mut c, vptr, vlen));
            c.data_mut().properties.insert(path, value);
            ok()
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: C<'_>,
         nptr: i32,
         nlen: i32,
         _aptr: i32,
         _alen: i32,
         _rptr: i32,
         _rlen: i32|
         -> Ret {
            c.data_mut().count("proxy_call_foreign_function");
            let _name = try_status!(read(&mut c, nptr, nlen));
            // No foreign functions are registered: Envoy answers NotFound for unknown names.
            st(Status::NotFound)
        },
    )?;
    l.func_wrap(ENV, "proxy_done", |mut c: C<'_>| -> Ret {
        c.data_mut().count("proxy_done");
        // Envoy ignores `proxy_on_done`'s answer for HTTP streams, so nothing is ever pending.
        st(Status::NotFound)
    })?;
    l.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| -> Ret {
            c.data_mut().count("proxy_set_effective_context");
            let s = c.data_mut();
            let id = id as u32;
            let known = id == s.root_context_id || s.streams.get(&id).is_some_and(|st| !st.deleted);
            if !known {
                return st(Status::BadArgument);
            }
            s.effective_context = id;
            ok()
        },
    )?;
    Ok(())
}

fn metric_op(c: &mut C<'_>, id: u32, op: MetricOpKind) -> Ret {
    let context_id = c.data().context_id();
    let s = c.data_mut();
    let (status, name) = match s.metric_ids.get(&id) {
        None => (Status::NotFound, String::new()),
        Some((_, name)) => {
            let status = match op {
                MetricOpKind::Increment(delta) => s.stats.increment(name, delta),
                MetricOpKind::Record(value) => s.stats.record(name, value),
                MetricOpKind::Define(_) => Status::Ok,
            };
            (status, name.clone())
        }
    };
    s.capture.metric_ops.push(MetricOp {
        context_id,
        name,
        kind: op,
        status,
    });
    st(status)
}

/// ABI 0.2.1 calls this host does not implement (gRPC, shared queues): defined with their
/// real signatures so they answer `Unimplemented` even when not linked through a stub.
fn define_unimplemented_proxy(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    macro_rules! unimpl {
        ($name:literal, ($($p:ident),*)) => {
            l.func_wrap(ENV, $name, |mut c: C<'_>, $($p: i32),*| -> Ret {
                let _ = ($($p),*);
                unimplemented(&mut c, ENV, $name);
                st(Status::Unimplemented)
            })?;
        };
    }
    unimpl!("proxy_grpc_call", (a, b, c2, d, e, f, g, h, i, j, k, m));
    unimpl!("proxy_grpc_stream", (a, b, c2, d, e, f, g, h, i));
    unimpl!("proxy_grpc_send", (a, b, c2, d));
    unimpl!("proxy_grpc_cancel", (a));
    unimpl!("proxy_grpc_close", (a));
    unimpl!("proxy_register_shared_queue", (a, b, c2));
    unimpl!("proxy_resolve_shared_queue", (a, b, c2, d, e));
    unimpl!("proxy_enqueue_shared_queue", (a, b, c2));
    unimpl!("proxy_dequeue_shared_queue", (a, b, c2));
    Ok(())
}

/// Appends to a stdout/stderr line buffer and logs every complete line, as Envoy does.
fn write_fd(c: &mut C<'_>, fd: i32, bytes: &[u8]) {
    let level = if fd == 1 {
        LogLevel::Info
    } else {
        LogLevel::Error
    };
    let buf = if fd == 1 {
        &mut c.data_mut().stdout
    } else {
        &mut c.data_mut().stderr
    };
    buf.extend_from_slice(bytes);
    let mut lines = Vec::new();
    while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = buf.drain(..=nl).collect();
        lines.push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
    }
    for line in lines {
        log(c, level, line);
    }
}

fn define_wasi(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    l.func_wrap(
        WASI,
        "fd_write",
        |mut c: C<'_>, fd: i32, iovs: i32, n: i32, written_ptr: i32| -> Ret {
            c.data_mut().count("fd_write");
            if fd != 1 && fd != 2 {
                return Ok(errno::BADF);
            }
            let Ok(raw) = read(&mut c, iovs, n.saturating_mul(8)) else {
                return Ok(errno::FAULT);
            };
            let mut bytes = Vec::new();
            for iov in raw.chunks_exact(8) {
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                match read(&mut c, ptr, len) {
                    Ok(b) => bytes.extend_from_slice(&b),
                    Err(_) => return Ok(errno::FAULT),
                }
            }
            write_fd(&mut c, fd, &bytes);
            if write_u32(&mut c, written_ptr, bytes.len() as u32).is_err() {
                return Ok(errno::FAULT);
            }
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(
        WASI,
        "clock_time_get",
        |mut c: C<'_>, id: i32, _precision: i64, ptr: i32| -> Ret {
            c.data_mut().count("clock_time_get");
            // Realtime and monotonic both follow the host clock; the others are not supported.
            if id != 0 && id != 1 {
                return Ok(errno::NOTSUP);
            }
            let now = c.data().clock.now_ns();
            Ok(write_u64(&mut c, ptr, now).map_or(errno::FAULT, |()| errno::SUCCESS))
        },
    )?;
    l.func_wrap(
        WASI,
        "clock_res_get",
        |mut c: C<'_>, id: i32, ptr: i32| -> Ret {
            c.data_mut().count("clock_res_get");
            if id != 0 && id != 1 {
                return Ok(errno::NOTSUP);
            }
            Ok(write_u64(&mut c, ptr, 1).map_or(errno::FAULT, |()| errno::SUCCESS))
        },
    )?;
    l.func_wrap(
        WASI,
        "random_get",
        |mut c: C<'_>, ptr: i32, len: i32| -> Ret {
            c.data_mut().count("random_get");
            let len = len as u32 as usize;
            if len > 1 << 20 {
                return Ok(errno::INVAL);
            }
            let bytes: Vec<u8> = (0..len).map(|_| c.data_mut().random_byte()).collect();
            Ok(write(&mut c, ptr, &bytes).map_or(errno::FAULT, |()| errno::SUCCESS))
        },
    )?;
    l.func_wrap(
        WASI,
        "environ_sizes_get",
        |mut c: C<'_>, count_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("environ_sizes_get");
            let env = environ(&c);
            let size: usize = env.iter().map(Vec::len).sum();
            let r = write_u32(&mut c, count_ptr, env.len() as u32)
                .and_then(|()| write_u32(&mut c, size_ptr, size as u32));
            Ok(r.map_or(errno::FAULT, |()| errno::SUCCESS))
        },
    )?;
    l.func_wrap(
        WASI,
        "environ_get",
        |mut c: C<'_>, array_ptr: i32, buf_ptr: i32| -> Ret {
            c.data_mut().count("environ_get");
            let mut at = buf_ptr;
            for (i, entry) in environ(&c).into_iter().enumerate() {
                let r = write_u32(&mut c, array_ptr + 4 * i as i32, at as u32)
                    .and_then(|()| write(&mut c, at, &entry));
                if r.is_err() {
                    return Ok(errno::FAULT);
                }
                at += entry.len() as i32;
            }
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(
        WASI,
        "args_sizes_get",
        |mut c: C<'_>, argc_ptr: i32, size_ptr: i32| -> Ret {
            c.data_mut().count("args_sizes_get");
            let r = write_u32(&mut c, argc_ptr, 0).and_then(|()| write_u32(&mut c, size_ptr, 0));
            Ok(r.map_or(errno::FAULT, |()| errno::SUCCESS))
        },
    )?;
    l.func_wrap(
        WASI,
        "args_get",
        |mut c: C<'_>, _argv: i32, _buf: i32| -> Ret {
            c.data_mut().count("args_get");
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(WASI, "sched_yield", |mut c: C<'_>| -> Ret {
        c.data_mut().count("sched_yield");
        Ok(errno::SUCCESS)
    })?;
    l.func_wrap(
        WASI,
        "proc_exit",
        |mut c: C<'_>, code: i32| -> wasmtime::Result<()> {
            c.data_mut().count("proc_exit");
            // The spec says it is never called; if it is, the VM is gone, exactly like a trap.
            wasmtime::bail!("the guest called proc_exit({code})")
        },
    )?;
    Ok(())
}

/// `KEY=VALUE\0` entries of the configured environment.
fn environ(c: &C<'_>) -> Vec<Vec<u8>> {
    c.data()
        .options
        .env
        .iter()
        .map(|(k, v)| {
            let mut e = format!("{k}={v}").into_bytes();
            e.push(0);
            e
        })
        .collect()
}
