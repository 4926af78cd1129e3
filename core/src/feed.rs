//! The page of KV truth the relay (`prefixroute kv-events`) serves and the plugin fetches:
//! per server, the router block hashes it stored and removed since a version.
//!
//! Binary and little-endian, like the plugin's shared-data records, so the plugin reads it
//! without a JSON parser: `magic "PRKV" | layout u8 | version u64 | flags u8 (1 = reset) | n u16 |
//! n × (address str | flags u8 (1 = live, 2 = cleared) | stored u32 | stored × u64 | removed u32
//! | removed × u64)`, a `str` being `len u16 | UTF-8`. `reset` means the page is a full snapshot
//! (the fetcher was too far behind): forget everything from the relay first. A server's
//! `cleared` means it lost everything before this page's `stored`; `live` is false while the
//! relay has no events from it (then its truth is unknown, not empty).

use thiserror::Error;

const MAGIC: &[u8; 4] = b"PRKV";
const LAYOUT: u8 = 1;
const RESET: u8 = 1;
const LIVE: u8 = 1;
const CLEARED: u8 = 2;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedServer {
    /// `ip:port`, as the pool names it.
    pub address: String,
    pub live: bool,
    pub cleared: bool,
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedPage {
    /// The version to ask for next (`?since=`).
    pub version: u64,
    pub reset: bool,
    pub servers: Vec<FeedServer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FeedError {
    #[error("not a prefixroute KV feed page (magic or layout)")]
    Foreign,
    #[error("the feed page is truncated")]
    Truncated,
    #[error("a server address in the feed page is not UTF-8")]
    Address,
}

impl FeedPage {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            16 + self
                .servers
                .iter()
                .map(|s| 16 + s.address.len() + 8 * (s.stored.len() + s.removed.len()))
                .sum::<usize>(),
        );
        out.extend_from_slice(MAGIC);
        out.push(LAYOUT);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.push(if self.reset { RESET } else { 0 });
        let servers = &self.servers[..self.servers.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(servers.len() as u16).to_le_bytes());
        for s in servers {
            let address = &s.address.as_bytes()[..s.address.len().min(u16::MAX as usize)];
            out.extend_from_slice(&(address.len() as u16).to_le_bytes());
            out.extend_from_slice(address);
            out.push((u8::from(s.live) * LIVE) | (u8::from(s.cleared) * CLEARED));
            for list in [&s.stored, &s.removed] {
                let list = &list[..list.len().min(u32::MAX as usize)];
                out.extend_from_slice(&(list.len() as u32).to_le_bytes());
                for h in list {
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
        }
        out
    }

    /// Reads a page; never panics, and never allocates more than the page's own length
    /// accounts for.
    pub fn decode(bytes: &[u8]) -> Result<FeedPage, FeedError> {
        let mut r = Cursor(bytes);
        if r.take(4)? != MAGIC || r.u8()? != LAYOUT {
            return Err(FeedError::Foreign);
        }
        let version = r.u64()?;
        let reset = r.u8()? & RESET != 0;
        let n = r.u16()? as usize;
        let mut servers = Vec::with_capacity(n.min(r.0.len() / 11));
        for _ in 0..n {
            let len = r.u16()? as usize;
            let address = std::str::from_utf8(r.take(len)?)
                .map_err(|_| FeedError::Address)?
                .to_string();
            let flags = r.u8()?;
            let mut lists = [Vec::new(), Vec::new()];
            for list in &mut lists {
                let count = r.u32()? as usize;
                if r.0.len() / 8 < count {
                    return Err(FeedError::Truncated);
                }
                list.reserve_exact(count);
                for _ in 0..count {
                    list.push(r.u64()?);
                }
            }
            let [stored, removed] = lists;
            servers.push(FeedServer {
                address,
                live: flags & LIVE != 0,
                cleared: flags & CLEARED != 0,
                stored,
                removed,
            });
        }
        Ok(FeedPage {
            version,
            reset,
            servers,
        })
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FeedError> {
        if self.0.len() < n {
            return Err(FeedError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, FeedError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FeedError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, FeedError> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, FeedError> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page() -> FeedPage {
        FeedPage {
            version: 77,
            reset: true,
            servers: vec![
                FeedServer {
                    address: "10.0.0.1:8000".into(),
                    live: true,
                    cleared: false,
                    stored: vec![1, u64::MAX],
                    removed: vec![9],
                },
                FeedServer {
                    address: "[::1]:8000".into(),
                    live: false,
                    cleared: true,
                    stored: vec![],
                    removed: vec![],
                },
            ],
        }
    }

    #[test]
    fn a_page_round_trips_and_every_truncation_is_an_error() {
        let bytes = page().encode();
        assert_eq!(FeedPage::decode(&bytes), Ok(page()));
        for cut in 0..bytes.len() {
            assert!(FeedPage::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(FeedPage::decode(b"{\"json\": 1}"), Err(FeedError::Foreign));
    }

    #[test]
    fn a_huge_declared_count_is_refused_before_allocating() {
        let mut bytes = FeedPage {
            version: 1,
            reset: false,
            servers: vec![FeedServer {
                address: "a:1".into(),
                ..FeedServer::default()
            }],
        }
        .encode();
        // The stored count is the 4 bytes after the server's flags.
        let at = 4 + 1 + 8 + 1 + 2 + 2 + 3 + 1;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(FeedPage::decode(&bytes), Err(FeedError::Truncated));
    }
}
