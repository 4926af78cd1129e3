//! The page of KV truth the relay (`prefixroute kv-events`) serves and the plugin fetches:
//! per server, the router block hashes it stored and removed since a version.
//!
//! Binary and little-endian, like the plugin's shared-data records, so the plugin reads it
//! without a JSON parser: `magic "PRKV" | layout u8 | version u64 | flags u8 (1 = reset) | n u16 |
//! n × (address str | flags u8 (1 = live, 2 = cleared) | stored u32 | stored × u64 | removed u32
//! | removed × u64 | runs u32 | runs × (parent u64 | end u64 | blocks u32))`, a `str` being
//! `len u16 | UTF-8`, a parent of 0 meaning none. Layout 1, a relay from before runs, is the
//! same without them and still read. `reset` means the page is a full snapshot
//! (the fetcher was too far behind): forget everything from the relay first. A server's
//! `cleared` means it lost everything before this page's `stored`; `live` is false while the
//! relay has no events from it (then its truth is unknown, not empty).

use thiserror::Error;

const MAGIC: &[u8; 4] = b"PRKV";
const LAYOUT: u8 = 2;
/// The layout before [`FeedServer::runs`]: read (with no runs), never written.
const LAYOUT_WITHOUT_RUNS: u8 = 1;
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
    /// The blocks each `BlockStored` event stored, as one run per event, in order: one
    /// request's new full blocks (a prompt prefilled in one step), so its last block is where
    /// that request ended. A gateway learns from them the requests other gateways routed (see
    /// `Router::learn_stored`).
    pub runs: Vec<StoredRun>,
}

/// The blocks one `BlockStored` event stored on a server: they continue the chain after
/// `parent` (`None`: they start one) and the last is `end`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredRun {
    pub parent: Option<u64>,
    pub end: u64,
    pub blocks: u32,
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
    /// The page in the current layout, with runs (what a fetcher that asks for `layout=2`
    /// reads).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_layout(true)
    }

    /// The page in layout 1, without runs: for a fetcher that did not ask for layout 2 (a
    /// plugin from before runs rejects any other layout), so a relay can be upgraded before
    /// the gateways.
    pub fn encode_without_runs(&self) -> Vec<u8> {
        self.encode_layout(false)
    }

    fn encode_layout(&self, runs: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            16 + self
                .servers
                .iter()
                .map(|s| {
                    20 + s.address.len()
                        + 8 * (s.stored.len() + s.removed.len())
                        + 20 * s.runs.len()
                })
                .sum::<usize>(),
        );
        out.extend_from_slice(MAGIC);
        out.push(if runs { LAYOUT } else { LAYOUT_WITHOUT_RUNS });
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
            if !runs {
                continue;
            }
            let runs = &s.runs[..s.runs.len().min(u32::MAX as usize)];
            out.extend_from_slice(&(runs.len() as u32).to_le_bytes());
            for run in runs {
                out.extend_from_slice(&run.parent.unwrap_or(0).to_le_bytes());
                out.extend_from_slice(&run.end.to_le_bytes());
                out.extend_from_slice(&run.blocks.to_le_bytes());
            }
        }
        out
    }

    /// Reads a page; never panics, and never allocates more than the page's own length
    /// accounts for.
    pub fn decode(bytes: &[u8]) -> Result<FeedPage, FeedError> {
        let mut r = Cursor(bytes);
        if r.take(4)? != MAGIC {
            return Err(FeedError::Foreign);
        }
        let with_runs = match r.u8()? {
            LAYOUT => true,
            LAYOUT_WITHOUT_RUNS => false,
            _ => return Err(FeedError::Foreign),
        };
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
            let count = if with_runs { r.u32()? as usize } else { 0 };
            if r.0.len() / 20 < count {
                return Err(FeedError::Truncated);
            }
            let mut runs = Vec::with_capacity(count);
            for _ in 0..count {
                runs.push(StoredRun {
                    parent: Some(r.u64()?).filter(|&p| p != 0),
                    end: r.u64()?,
                    blocks: r.u32()?,
                });
            }
            servers.push(FeedServer {
                address,
                live: flags & LIVE != 0,
                cleared: flags & CLEARED != 0,
                stored,
                removed,
                runs,
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
                    runs: vec![
                        StoredRun {
                            parent: None,
                            end: 1,
                            blocks: 1,
                        },
                        StoredRun {
                            parent: Some(1),
                            end: u64::MAX,
                            blocks: 1,
                        },
                    ],
                },
                FeedServer {
                    address: "[::1]:8000".into(),
                    live: false,
                    cleared: true,
                    stored: vec![],
                    removed: vec![],
                    runs: vec![],
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
        // So is a huge run count: the last 4 bytes of a server with empty lists.
        let mut bytes = FeedPage {
            version: 1,
            reset: false,
            servers: vec![FeedServer::default()],
        }
        .encode();
        let at = bytes.len() - 4;
        bytes[at..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(FeedPage::decode(&bytes), Err(FeedError::Truncated));
    }

    #[test]
    fn a_page_without_runs_is_layout_1_and_reads_back_without_them() {
        let mut bytes = page().encode_without_runs();
        assert_eq!(bytes[4], LAYOUT_WITHOUT_RUNS);
        let mut without = page();
        for s in &mut without.servers {
            s.runs.clear();
        }
        assert_eq!(FeedPage::decode(&bytes), Ok(without.clone()));
        // Layout 1 is layout 2 without the run counts: the same page, 4 bytes per server less.
        assert_eq!(bytes.len() + 2 * 4, without.encode().len());
        for cut in 0..bytes.len() {
            assert!(FeedPage::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        bytes[4] = 3;
        assert_eq!(FeedPage::decode(&bytes), Err(FeedError::Foreign));
    }
}
