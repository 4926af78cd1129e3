//! Where a request's wasm instructions go, by guest function: the fuel left at each point a
//! module instrumented by binaryen's `wasm-opt --log-execution` logs (every function's entry
//! and every loop's head, see [`crate::Vm::record_execution`]), charged to the function of the
//! point it was spent after.
//!
//! Exact where the points are dense (a loop's body is charged to its function) and
//! approximate across calls: what a caller does after a callee returns, up to its next logged
//! point, is charged to the callee. So a small function called from straight-line code reads
//! high (the caller's arithmetic after `f64::max` was charged to `fmax`), and wasm's own count
//! is not the CPU's (a `local.get` is an instruction here and nothing after compilation).
//! Use it to find where to look, then measure a change with the cost table and Envoy's CPU.
use std::collections::HashMap;

/// The function each logged point is in, from the instrumented module's text (`wasm-dis`
/// output: `(func $name` opens a function, `(call $log_execution` followed by
/// `(i32.const ID)` is a point).
pub fn points_by_function(wat: &str) -> HashMap<u32, String> {
    let mut points = HashMap::new();
    let mut function = String::new();
    let mut lines = wat.lines();
    while let Some(line) = lines.next() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("(func $") {
            let symbol = rest.split_whitespace().next().unwrap_or_default();
            // Without the hash suffix: `{:#}`.
            function = format!("{:#}", rustc_demangle::demangle(symbol));
        } else if line.starts_with("(call $log_execution") {
            let id = lines
                .next()
                .and_then(|next| next.trim().strip_prefix("(i32.const "))
                .and_then(|rest| rest.trim_end_matches(')').parse().ok());
            if let Some(id) = id {
                points.insert(id, function.clone());
            }
        }
    }
    points
}

/// Instructions per function, most first, with the points reached in it: each gap between
/// two consecutive points of `log` (id, fuel left) is charged to the first one's function.
pub fn by_function(log: &[(u32, u64)], points: &HashMap<u32, String>) -> Vec<(String, u64, u64)> {
    let mut totals: HashMap<&str, (u64, u64)> = HashMap::new();
    for pair in log.windows(2) {
        let (id, left) = pair[0];
        let name = points.get(&id).map_or("?", String::as_str);
        let entry = totals.entry(name).or_default();
        entry.0 += left.saturating_sub(pair[1].1);
        entry.1 += 1;
    }
    let mut rows: Vec<(String, u64, u64)> = totals
        .into_iter()
        .map(|(name, (fuel, reached))| (name.to_string(), fuel, reached))
        .collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAT: &str = "(module\n (func $outer (param $0 i32)\n  (call $log_execution\n   (i32.const 0)\n  )\n  (loop $l\n   (call $log_execution\n    (i32.const 1)\n   )\n  )\n )\n (func $inner\n  (call $log_execution\n   (i32.const 2)\n  )\n )\n)\n";

    #[test]
    fn points_are_found_in_the_functions_they_are_logged_in() {
        let points = points_by_function(WAT);
        assert_eq!(points.len(), 3);
        assert_eq!(points[&0], "outer");
        assert_eq!(points[&1], "outer");
        assert_eq!(points[&2], "inner");
    }

    #[test]
    fn each_gap_is_charged_to_the_function_of_the_point_before_it() {
        let points = points_by_function(WAT);
        // outer's entry, two loop heads, a call of inner, back in the loop; the last point
        // ends the recording.
        let log = [(0, 1000), (1, 990), (1, 970), (2, 960), (1, 900), (0, 890)];
        let rows = by_function(&log, &points);
        let expected = vec![("inner".to_string(), 60, 1), ("outer".to_string(), 50, 4)];
        assert_eq!(rows, expected);
    }
}
