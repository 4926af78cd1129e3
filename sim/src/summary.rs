//! Small summaries shared by the simulator, the load replayer and the benchmarks.

use std::collections::BTreeMap;

/// Nearest-rank percentile (`p` in 0..100) of unsorted values; 0 for no values.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// How many groups sent all their requests to a single endpoint, out of how many groups.
pub fn groups_on_one_endpoint<'a>(
    routes: impl IntoIterator<Item = (&'a str, usize)>,
) -> (usize, usize) {
    let mut seen: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
    for (group, endpoint) in routes {
        seen.entry(group)
            .and_modify(|(first, single)| *single &= *first == endpoint)
            .or_insert((endpoint, true));
    }
    let single = seen.values().filter(|(_, single)| *single).count();
    (single, seen.len())
}

/// A sort key that puts `tenant-10` after `tenant-9`.
pub fn natural_key(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, number) = name.split_at(name.len() - digits);
    (stem.to_string(), number.parse().unwrap_or(0))
}

/// Max over mean of per-endpoint request counts: 1.0 is perfectly even.
pub fn max_over_mean(counts: &[usize]) -> f64 {
    let total: usize = counts.iter().sum();
    if counts.is_empty() || total == 0 {
        return 0.0;
    }
    let mean = total as f64 / counts.len() as f64;
    *counts.iter().max().unwrap_or(&0) as f64 / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 95.0), 95.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.0), 1.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn groups_on_one_counts_single_endpoint_groups() {
        let routes = [("a", 0), ("b", 1), ("a", 0), ("b", 2), ("c", 1)];
        assert_eq!(groups_on_one_endpoint(routes), (2, 3));
    }

    #[test]
    fn max_over_mean_measures_imbalance() {
        assert_eq!(max_over_mean(&[5, 5]), 1.0);
        assert_eq!(max_over_mean(&[9, 1, 2]), 2.25);
        assert_eq!(max_over_mean(&[]), 0.0);
    }
}
