//! Prefill/decode disaggregation of a simulated fleet: the `disagg` calculator's arithmetic
//! applied to every request of a trace.
//!
//! The router routes every request to a *decode* replica as usual. If the tokens it predicts
//! uncached there reach the threshold (llm-d's rule, [`crate::disagg::prefill_site`]), a
//! *prefill* replica computes the tokens the decode replica really lacks, their KV cache moves
//! over that prefill replica's link ([`crate::disagg::transfer_ms`]; one transfer at a time per
//! link), and decoding starts on the decode replica, whose cache now holds those blocks.
//! Otherwise the decode replica prefills locally, as in aggregated serving.
//!
//! What a local prefill costs the *other* requests decoding on that replica is measured after
//! the run ([`decode_stalls`]): without chunked prefill the GPU runs the whole prefill between
//! two decode steps, so each request decoding meanwhile waits for it; with chunked prefill of
//! `C` tokens the same work rides along `⌈U/C⌉` decode steps, so the total delay is the same
//! but no gap between two tokens grows by more than one chunk.
//!
//! Simplifications, stated: prefill replicas have no prefix cache of their own (they compute
//! every token the decode replica lacks) and pick by least queue; a replica's prefills run in
//! its parallel lanes as in the aggregated model (only decoding is stalled by them); a stall
//! delays the tokens but not the lane's release (lanes are freed on the unstalled schedule);
//! the router's ledger learns its prefill rate only from requests prefilled where they decode.

use serde::{Deserialize, Serialize};

use crate::disagg::{transfer_ms, DisaggError};
use crate::replica::ReplicaTiming;

/// How the fleet is split.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PdConfig {
    /// Replicas that only prefill (0: every request prefills where it decodes).
    pub prefill_replicas: usize,
    /// Prefill remotely when the router predicts at least this many uncached tokens.
    pub threshold_tokens: u64,
    /// Each prefill replica's link to the decode replicas, Gb/s.
    pub link_gbps: f64,
    pub link_latency_ms: f64,
    /// The model's KV cache per token (`disagg::ModelShape::kv_bytes_per_token`).
    pub kv_bytes_per_token: u64,
    /// Chunked prefill on the decode replicas, tokens per chunk.
    pub chunk_tokens: Option<u32>,
}

impl PdConfig {
    pub fn validate(&self) -> Result<(), DisaggError> {
        let invalid = |field, value, reason| DisaggError::InvalidNumber {
            field,
            value,
            reason,
        };
        if !(self.link_gbps > 0.0 && self.link_gbps.is_finite()) {
            return Err(invalid(
                "link_gbps",
                self.link_gbps,
                "must be a finite number > 0",
            ));
        }
        if !(self.link_latency_ms >= 0.0 && self.link_latency_ms.is_finite()) {
            return Err(invalid(
                "link_latency_ms",
                self.link_latency_ms,
                "must be a finite number >= 0",
            ));
        }
        if self.kv_bytes_per_token == 0 {
            return Err(invalid("kv_bytes_per_token", 0.0, "must be > 0"));
        }
        if self.chunk_tokens == Some(0) {
            return Err(invalid("chunk_tokens", 0.0, "must be > 0 (or absent)"));
        }
        Ok(())
    }
}

/// One request's prefill on a prefill replica and its KV transfer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RemotePrefill {
    pub prefill_replica: usize,
    /// Tokens computed and moved: those the decode replica lacked.
    pub tokens: usize,
    pub kv_bytes: u64,
    pub prefill_start_ms: f64,
    pub prefill_end_ms: f64,
    pub transfer_ms: f64,
    /// When the KV cache is on the decode replica.
    pub kv_ready_ms: f64,
}

/// The prefill replicas: lanes (no cache) and one outgoing link each.
#[derive(Debug, Clone)]
pub struct PrefillPool {
    timing: ReplicaTiming,
    lane_free_at: Vec<Vec<f64>>,
    link_free_at: Vec<f64>,
    link_busy_ms: f64,
}

impl PrefillPool {
    pub fn new(replicas: usize, timing: ReplicaTiming) -> Self {
        PrefillPool {
            timing,
            lane_free_at: vec![vec![0.0; timing.lanes.max(1)]; replicas],
            link_free_at: vec![0.0; replicas],
            link_busy_ms: 0.0,
        }
    }

    pub fn replicas(&self) -> usize {
        self.lane_free_at.len()
    }

    /// Time the links spent moving KV cache, summed over links.
    pub fn link_busy_ms(&self) -> f64 {
        self.link_busy_ms
    }

    /// Prefills `tokens` arriving at `now_ms` on the replica that can start soonest (least
    /// queue; ties to the lower index) and ships their KV cache over its link.
    pub fn prefill(&mut self, now_ms: f64, tokens: usize, config: &PdConfig) -> RemotePrefill {
        let earliest = |lanes: &Vec<f64>| lanes.iter().copied().fold(f64::INFINITY, f64::min);
        let replica = (0..self.replicas())
            .min_by(|&a, &b| {
                earliest(&self.lane_free_at[a]).total_cmp(&earliest(&self.lane_free_at[b]))
            })
            .unwrap_or(0);
        let lanes = &mut self.lane_free_at[replica];
        let lane = (0..lanes.len())
            .min_by(|&a, &b| lanes[a].total_cmp(&lanes[b]))
            .unwrap_or(0);
        let start = lanes[lane].max(now_ms);
        let end = start
            + self.timing.prefill_overhead_ms
            + tokens as f64 * self.timing.prefill_ms_per_token;
        lanes[lane] = end;
        let kv_bytes = tokens as u64 * config.kv_bytes_per_token;
        let transfer = transfer_ms(kv_bytes, config.link_gbps, config.link_latency_ms);
        let link_start = self.link_free_at[replica].max(end);
        let kv_ready_ms = link_start + transfer;
        self.link_free_at[replica] = kv_ready_ms;
        self.link_busy_ms += transfer;
        RemotePrefill {
            prefill_replica: replica,
            tokens,
            kv_bytes,
            prefill_start_ms: start,
            prefill_end_ms: end,
            transfer_ms: transfer,
            kv_ready_ms,
        }
    }
}

/// A time span on one decode replica, in ms: a request's decoding (first token to last) or a
/// local prefill (its start to its first token) with the tokens it computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub replica: usize,
    pub start_ms: f64,
    pub end_ms: f64,
    pub tokens: usize,
}

/// What local prefills did to one request's decoding.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stall {
    /// Time its tokens waited for other requests' prefills, in total.
    pub total_ms: f64,
    /// Its longest gap between two tokens: one decode step plus the longest prefill (or chunk)
    /// that ran between them.
    pub worst_gap_ms: f64,
}

/// The stall each decode window suffers from the local prefills on its replica that overlap
/// it (see the module docs; `chunk_tokens` bounds the gap, not the total).
pub fn decode_stalls(
    decodes: &[Span],
    prefills: &[Span],
    timing: &ReplicaTiming,
    chunk_tokens: Option<u32>,
) -> Vec<Stall> {
    let mut by_start: Vec<&Span> = prefills.iter().collect();
    by_start.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    decodes
        .iter()
        .map(|d| {
            let mut stall = Stall {
                total_ms: 0.0,
                worst_gap_ms: timing.decode_ms_per_token,
            };
            for p in by_start.iter().take_while(|p| p.start_ms < d.end_ms) {
                if p.replica != d.replica || p.end_ms <= d.start_ms {
                    continue;
                }
                let overlap = p.end_ms.min(d.end_ms) - p.start_ms.max(d.start_ms);
                stall.total_ms += overlap;
                let burst = match chunk_tokens {
                    Some(c) => (c as usize).min(p.tokens) as f64 * timing.prefill_ms_per_token,
                    None => overlap,
                };
                stall.worst_gap_ms = stall.worst_gap_ms.max(timing.decode_ms_per_token + burst);
            }
            stall
        })
        .collect()
}

/// The split's own numbers in a report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PdStats {
    pub prefill_replicas: usize,
    /// Requests prefilled on a prefill replica, 0..1.
    pub remote_prefill_share: f64,
    pub kv_bytes_moved: u64,
    /// Share of the links' time spent moving KV cache over the run (first arrival to last
    /// token), 0..1.
    pub link_busy_share: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing() -> ReplicaTiming {
        ReplicaTiming {
            lanes: 1,
            prefill_overhead_ms: 5.0,
            prefill_ms_per_token: 0.5,
            decode_ms_per_token: 10.0,
        }
    }

    fn config(link_gbps: f64) -> PdConfig {
        PdConfig {
            prefill_replicas: 2,
            threshold_tokens: 100,
            link_gbps,
            link_latency_ms: 1.0,
            kv_bytes_per_token: 131_072,
            chunk_tokens: None,
        }
    }

    #[test]
    fn a_remote_prefill_takes_the_least_queued_replica_then_its_link() {
        let mut pool = PrefillPool::new(2, timing());
        let c = config(8.0);
        let a = pool.prefill(0.0, 1000, &c);
        // 1000 tokens: 5 + 500 ms of prefill; 131 MB at 8 Gb/s: 131.072 ms + 1 ms latency.
        assert_eq!((a.prefill_replica, a.prefill_end_ms), (0, 505.0));
        assert_eq!(a.kv_bytes, 131_072_000);
        assert!((a.transfer_ms - 132.072).abs() < 1e-9, "{}", a.transfer_ms);
        assert!((a.kv_ready_ms - 637.072).abs() < 1e-9);
        let b = pool.prefill(10.0, 1000, &c);
        assert_eq!(b.prefill_replica, 1, "replica 0's only lane is busy");
        let third = pool.prefill(20.0, 10, &c);
        // Replica 0 frees first (505 ms); its link is still busy with a's transfer until 637.
        assert_eq!((third.prefill_replica, third.prefill_start_ms), (0, 505.0));
        assert!((third.kv_ready_ms - (637.072 + third.transfer_ms)).abs() < 1e-9);
        assert!((pool.link_busy_ms() - (2.0 * 132.072 + third.transfer_ms)).abs() < 1e-9);
    }

    #[test]
    fn overlapping_local_prefills_stall_decoding_and_chunking_bounds_the_gap() {
        let t = timing();
        let decode = Span {
            replica: 0,
            start_ms: 100.0,
            end_ms: 300.0,
            tokens: 0,
        };
        let prefills = [
            // 80 ms inside the window, 200 tokens.
            Span {
                replica: 0,
                start_ms: 150.0,
                end_ms: 230.0,
                tokens: 200,
            },
            // Straddles the end: 20 ms count.
            Span {
                replica: 0,
                start_ms: 280.0,
                end_ms: 400.0,
                tokens: 300,
            },
            // Another replica, or before the window: nothing.
            Span {
                replica: 1,
                start_ms: 150.0,
                end_ms: 250.0,
                tokens: 1,
            },
            Span {
                replica: 0,
                start_ms: 0.0,
                end_ms: 100.0,
                tokens: 9,
            },
        ];
        let plain = decode_stalls(&[decode], &prefills, &t, None)[0];
        assert!((plain.total_ms - 100.0).abs() < 1e-9);
        assert!(
            (plain.worst_gap_ms - 90.0).abs() < 1e-9,
            "10 ms step + 80 ms prefill"
        );
        let chunked = decode_stalls(&[decode], &prefills, &t, Some(64))[0];
        assert_eq!(
            chunked.total_ms, plain.total_ms,
            "the same work, spread out"
        );
        assert!((chunked.worst_gap_ms - (10.0 + 64.0 * 0.5)).abs() < 1e-9);
        let alone = decode_stalls(&[decode], &[], &t, None)[0];
        assert_eq!((alone.total_ms, alone.worst_gap_ms), (0.0, 10.0));
    }

    #[test]
    fn bad_links_and_chunks_are_refused() {
        for (bad, field) in [
            (
                PdConfig {
                    link_gbps: -1.0,
                    ..config(1.0)
                },
                "link_gbps",
            ),
            (
                PdConfig {
                    link_gbps: f64::NAN,
                    ..config(1.0)
                },
                "link_gbps",
            ),
            (
                PdConfig {
                    link_latency_ms: -0.1,
                    ..config(1.0)
                },
                "link_latency_ms",
            ),
            (
                PdConfig {
                    chunk_tokens: Some(0),
                    ..config(1.0)
                },
                "chunk_tokens",
            ),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
        assert!(config(400.0).validate().is_ok());
    }
}
